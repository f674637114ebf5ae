"""Every message of a round between rank 0 and the client ranks, in one place.

The exchange encodes what the round loop hands it into declared tensor messages, moves them
through the transport, and on rank 0 decodes and screens what came back: a rank's message that
breaks its declaration is named (``runtime.placement.Placement.describe_rank``) and, by
``on_bad_upload``, either ends the job or has its clients left out of the round, reported back
to the loop in the round's outcome. It also counts the bytes that crossed the boundary. It knows
nothing of algorithms (they arrive as declared fields and payloads) or of metrics.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, max_message_bytes
from htfl_dist.runtime.placement import Placement
from htfl_dist.runtime.screening import (
    EVAL_WIDTH,
    LeftOut,
    check_rank_entries,
    check_rank_report,
    check_rank_row,
    screen_uploads,
    unpack_rank_message,
)
from htfl_dist.runtime.transport import Transport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, Encoded, decode, encode, pass_within_process

RANK_ENTRY = -1
"""Report entry that carries rank-level figures (a RankReport) rather than a client's."""


class RankReport(NamedTuple):
    """What each rank tells rank 0 about itself at the end of a round (the ``rank`` report row)."""

    compute_seconds: float
    theory_up_bytes: float
    stop_requested: float  # 1.0: this rank saw SIGTERM


REPORT_SPEC = (
    Field("train", torch.float64, (2,), max_rows=1),  # [loss_sum, samples]
    Field("eval", torch.float64, (EVAL_WIDTH,), max_rows=1),  # evaluation.test_client's row
    Field("rank", torch.float64, (len(RankReport._fields),), max_rows=1),  # rank entry only
    Field("privacy", torch.float64, (1,), max_rows=1),  # [ε spent so far]; privacy.enabled only
)

CONTROL_SPEC = (Field("stop", torch.int64),)  # rank 0's decision at each round boundary
STOP, DIVERGING, GIVE_UP, FINISHED = 1, 2, 4, 8
"""Bits of that decision: a rank saw SIGTERM; every participant's loss was not finite this round
(no periodic checkpoint of such a state); ``train.max_diverged_rounds`` such rounds in a row."""


def every_loss_diverged(reports: dict[int, Payload]) -> bool:
    """Every client that trained this round reported a loss that is not finite."""
    losses = [float(r["train"][0, 0]) for r in reports.values() if r["train"].shape[0] and r["train"][0, 1] > 0]
    return bool(losses) and not any(math.isfinite(loss) for loss in losses)


@dataclass
class RoundTraffic:
    """Bytes that crossed the server/client boundary in one round."""

    up: int = 0
    down: int = 0
    theory_up: int = 0
    theory_down: int = 0


class RoundReports(NamedTuple):
    """Rank 0's view of a round's reports: each client's rows, and each rank's own row (rank order)."""

    clients: dict[int, Payload]
    ranks: list[RankReport]


class StopDecision:
    """Rank 0's decision at each round boundary, as CONTROL_SPEC's bits: STOP when any rank saw
    SIGTERM; DIVERGING when every participant's loss was not finite this round; GIVE_UP after
    ``max_diverged_rounds`` such rounds in a row (0: never); FINISHED when the run has converged
    (``stop.patience``: the caller says so)."""

    def __init__(self, max_diverged_rounds: int) -> None:
        self.max_diverged_rounds = max_diverged_rounds
        self.diverged_rounds = 0

    def decide(self, reports: RoundReports, converged: bool = False) -> int:
        self.diverged_rounds = self.diverged_rounds + 1 if every_loss_diverged(reports.clients) else 0
        limit = self.max_diverged_rounds
        return ((STOP if any(r.stop_requested for r in reports.ranks) else 0)
                | (DIVERGING if self.diverged_rounds else 0)
                | (GIVE_UP if limit and self.diverged_rounds >= limit else 0)
                | (FINISHED if converged else 0))


class ClientReport(NamedTuple):
    """One client's report rows; None where the client has nothing of that kind this round."""

    train: list[float] | None  # [loss_sum, samples]
    evaluation: list[float] | None  # [correct, correct by the head, samples, AUC (NaN: undefined)]
    epsilon: list[float] | None  # [ε spent so far], privacy.enabled only


def _rows(values: list[float] | None, width: int) -> torch.Tensor:
    if values is None:
        return torch.empty(0, width, dtype=torch.float64)
    return torch.tensor([values], dtype=torch.float64)


def message_bounds(transport: Transport, spec, entries_of_rank) -> list[int | None] | None:
    """Rank 0: per rank, the most bytes its message of ``spec`` can truthfully hold given the
    entries it speaks for (``entries_of_rank(rank)``), so no peer's header decides an allocation;
    other ranks need none."""
    if transport.rank != 0:
        return None
    return [max_message_bytes(spec, entries_of_rank(rank)) for rank in range(transport.world_size)]


def _check_only_hosted_ledgers(entries: dict[int, Payload], hosted: list[int]) -> None:
    """Only a client's home rank holds its privacy ledger between rounds, so only it reports ε."""
    foreign = sorted(cid for cid, entry in entries.items() if entry["privacy"].shape[0] and cid not in hosted)
    if foreign:
        raise ProtocolError(f"reported privacy ε for clients {foreign} it does not host")


class Exchange:
    """The round's messages for one rank: broadcasts down, gathers up (decoded on rank 0)."""

    def __init__(self, transport: Transport, placement: Placement, device: torch.device,
                 on_bad_upload: Literal["skip", "fail"], epsilon_budget: float | None = None) -> None:
        self.transport = transport
        self.placement = placement
        self.device = device
        self.on_bad_upload = on_bad_upload
        self.epsilon_budget = epsilon_budget
        """privacy.target_epsilon with privacy on: no client can truthfully report more ε spent."""
        self.within_process = transport.world_size == 1
        """Server and clients share this process: payloads are not encoded and decoded
        (``wire.pass_within_process``), with the same checks and byte counts; the download is
        copied (the server keeps it), the uploads handed over (the train phase owns them)."""
        self.training_reported = epsilon_budget is None
        """Whether clients report their training rows (loss sum, samples). A private client's
        training loss and sample count are computed from its training records without noise, so
        with privacy on they stay on the client and a rank that sends them is refused."""

    def broadcast_knowledge(self, spec, download: Payload | None, traffic: RoundTraffic) -> Payload:
        """The server's ``download`` (rank 0; None elsewhere) to every rank, decoded on each."""
        if not spec:
            return {}  # the algorithm shares nothing server → clients: nothing travels
        if self.within_process:
            assert download is not None, "rank 0 passes the server's download"
            copied, nbytes = pass_within_process(spec, {BROADCAST_ENTRY: download}, self.device)
            traffic.down += nbytes  # the one client rank (this one), as below
            return copied[BROADCAST_ENTRY]
        message = None
        if self.transport.rank == 0:
            assert download is not None, "rank 0 passes the server's download"
            message = encode(spec, {BROADCAST_ENTRY: download})
        received = self.transport.broadcast(message)
        receivers = sum(rank != 0 for rank in self.placement.client_ranks)  # rank 0 hands its own clients the copy
        traffic.down += received.nbytes * receivers
        return decode(spec, received, self.device)[BROADCAST_ENTRY]

    def gather_uploads(self, spec, uploads: dict[int, Payload], participants: list[int], round_number: int,
                       traffic: RoundTraffic, left_out: LeftOut | None = None,
                       trainers: Mapping[int, int] | None = None
                       ) -> tuple[dict[int, Payload] | None, list[int]]:
        """This rank's participants' uploads to rank 0. Rank 0 gets every participant's decoded
        upload, in client-id order, and the clients left out because their rank's message broke
        its declaration (added to ``left_out``, the round's record its owner says once in one line;
        without one, said here); other ranks get (None, []). ``trainers``: the rank that trained
        each participant this round (default: its home), the one rank that may speak for it."""
        trainer_of = trainers.__getitem__ if trainers is not None else self.placement.rank_of
        if not spec:
            return ({} if self.transport.rank == 0 else None), []  # nothing declared, nothing travels
        messages: Sequence[Encoded | tuple[dict[int, Payload], int]] | None
        if self.within_process:  # rank 0's own clients: handed over (the train phase owns them), not encoded
            messages = [pass_within_process(spec, uploads, owned=True)]
        else:
            messages = self.transport.gather(encode(spec, uploads), message_bounds(
                self.transport, spec, lambda rank: sum(trainer_of(cid) == rank for cid in participants)))
        if messages is None:
            return None, []
        record = left_out if left_out is not None else LeftOut(round_number)
        merged: dict[int, Payload] = {}
        skipped: list[int] = []
        for rank, message in enumerate(messages):  # the transport gathers ranks in order, rank 0 first
            expected = [cid for cid in participants if trainer_of(cid) == rank]
            try:
                if isinstance(message, Encoded):
                    entries, nbytes = unpack_rank_message(spec, message, expected), message.nbytes
                else:
                    entries, nbytes = message
                    check_rank_entries(entries, expected)
            except ProtocolError as exc:
                sender = self.placement.describe_rank(rank)
                if self.on_bad_upload == "fail":
                    raise ProtocolError(f"{sender} {exc}") from None
                record.add_rank(sender, expected, exc)
                skipped.extend(expected)
                continue
            if entries:
                traffic.up += nbytes
            merged.update(entries)
        if left_out is None:
            record.say()
        return dict(sorted(merged.items())), skipped

    def gather_setup(self, spec, entries: dict[int, Payload], validate, traffic: RoundTraffic
                     ) -> dict[int, Payload] | None:
        """Every hosted client's setup payload to rank 0, screened by ``validate`` like uploads
        (rank 0: the kept payloads in client-id order; other ranks: None)."""
        gathered = self.transport.gather(encode(spec, entries), message_bounds(
            self.transport, spec, lambda rank: len(self.placement.clients_of(rank))))
        if gathered is None:
            return None
        merged: dict[int, Payload] = {}
        for message in gathered:
            traffic.up += message.nbytes if int(message.header[0]) > 0 else 0
            merged.update(decode(spec, message))
        kept, _ = screen_uploads(dict(sorted(merged.items())), validate, self.on_bad_upload, round_number=0)
        return kept

    def gather_reports(self, clients: dict[int, ClientReport], mine: RankReport, participants: list[int],
                       tested: Collection[int], trainers: Mapping[int, int] | None = None) -> RoundReports | None:
        """Each rank's report rows to rank 0, checked against what the rank can truthfully say
        (training rows for the participants it trained, ``trainers`` saying who trained whom
        (default: the homes); evaluation rows for the clients it hosts, unseen ones included, that
        were ``tested`` this round, none on a round without evaluation); a report that cannot be
        true ends the job naming its rank. A client trained away from home has its training row
        from its trainer and its evaluation row from its home, joined here."""
        trainer_of = trainers.__getitem__ if trainers is not None else self.placement.rank_of
        entries: dict[int, Payload] = {
            client_id: {"train": _rows(report.train, 2), "eval": _rows(report.evaluation, EVAL_WIDTH),
                        "rank": _rows(None, len(RankReport._fields)), "privacy": _rows(report.epsilon, 1)}
            for client_id, report in sorted(clients.items())}
        entries[RANK_ENTRY] = {"train": _rows(None, 2), "eval": _rows(None, EVAL_WIDTH),
                               "rank": _rows(list(mine), len(mine)), "privacy": _rows(None, 1)}
        placement = self.placement
        def trained_by(rank: int) -> list[int]:
            return [cid for cid in participants if trainer_of(cid) == rank]

        def entries_of(rank: int) -> int:
            hosted = placement.clients_of(rank) + placement.unseen_of(rank)
            return len(set(hosted) | set(trained_by(rank))) + 1

        gathered = self.transport.gather(encode(REPORT_SPEC, entries), message_bounds(
            self.transport, REPORT_SPEC, entries_of))
        if gathered is None:
            return None
        reports: dict[int, Payload] = {}
        rank_rows = []
        for rank, message in enumerate(gathered):  # ranks in order, rank 0 first
            hosted = placement.clients_of(rank) + placement.unseen_of(rank)
            try:
                decoded = decode(REPORT_SPEC, message)
                own = decoded.pop(RANK_ENTRY, None)
                if own is None or own["rank"].shape[0] != 1:
                    raise ProtocolError("sent a report without its rank row")
                check_rank_row(own["rank"][0].tolist())
                trained = trained_by(rank) if self.training_reported else []
                check_rank_report(decoded, trained, [cid for cid in hosted if cid in tested],
                                  epsilon_budget=self.epsilon_budget)
                _check_only_hosted_ledgers(decoded, hosted)
            except ProtocolError as exc:
                raise ProtocolError(f"{self.placement.describe_rank(rank)} {exc}") from None
            rank_rows.append(RankReport(*own["rank"][0].tolist()))
            for cid, entry in decoded.items():  # a lent client: training from its trainer, the rest from home
                earlier = reports.get(cid)
                reports[cid] = entry if earlier is None else {
                    name: rows if rows.shape[0] else earlier[name] for name, rows in entry.items()}
        return RoundReports(dict(sorted(reports.items())), rank_rows)

    def agree(self, bits: int | None) -> int:
        """Rank 0's decision bits (STOP, DIVERGING, GIVE_UP) to every rank, so all act at one
        round boundary; ``bits`` is rank 0's decision (None on the other ranks)."""
        decision = {BROADCAST_ENTRY: {"stop": torch.tensor([bits])}} if self.transport.rank == 0 else {}
        message = self.transport.broadcast(encode(CONTROL_SPEC, decision) if self.transport.rank == 0 else None)
        return int(decode(CONTROL_SPEC, message)[BROADCAST_ENTRY]["stop"][0])
