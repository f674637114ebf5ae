"""Server-side screening of uploads before the algorithm sees them (docs/architecture.md).

A bad upload (NaN/Inf values, class ids out of range, ...) is normal input in a long run with
many clients: by default the client is left out of that round and the run goes on
(``on_bad_upload: skip``), with one warning line per round that names every client left out and
each reason once (:class:`LeftOut`); ``on_bad_upload: fail`` ends the job instead.
"""
from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable

import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.wire import Encoded, Payload, PayloadSpec, decode


def check_finite(client_id: int, upload: Payload) -> None:
    """Refuse an upload holding NaN or ±Inf. The sum is asked first: any NaN or infinity makes it
    non-finite, and it costs a twentieth of an element-wise test over a model (0.17 against
    3.9 ms for 1.6 M floats); only a sum that is not finite (a bad value, or finite values whose
    sum overflows) is settled element by element."""
    for name, tensor in upload.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum())) \
                and not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"client {client_id} sent NaN/Inf values in '{name}': its local training "
                                f"diverged (lower train.lr or algo.reg_weight)")


EVAL_WIDTH = 6
"""Values in a client's evaluation row (``runtime.evaluation.test_client``): correct by the
algorithm's rule, correct by the head, samples, the head's AUC, FedNH's ``validclass`` and
``labeldist`` accuracies."""
SHOWN_REASONS = 3
"""The most distinct reasons one warning line spells out; the rest are counted (every client left
out is in the metrics row's ``skipped_clients`` anyway)."""
SHOWN_RANGES = 12
"""The most runs of consecutive client ids a list in the line spells out."""


def id_ranges(ids: list[int]) -> str:
    """``[1, 2, 3, 5]`` as '1-3, 5': a thousand diverged clients must not make a thousand-id line."""
    runs: list[list[int]] = []
    for client_id in sorted(set(ids)):
        if runs and client_id == runs[-1][1] + 1:
            runs[-1][1] = client_id
        else:
            runs.append([client_id, client_id])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:SHOWN_RANGES])
    return text if len(runs) <= SHOWN_RANGES else f"{text}, ... ({len(set(ids))} in all)"


class LeftOut:
    """The clients one round left out and why, said in one warning line. A line per client per
    round made a flood of a run whose training diverged (``train.lr=1e30``: 18 lines for 6 clients
    in 3 rounds before the run gave up); the line names every client left out and each distinct
    reason once, the first client's in full ('left client 0 out: client 0 sent NaN/Inf values
    ...; likewise clients 1-5'), and the metrics row's ``skipped_clients`` keeps the list."""

    def __init__(self, round_number: int) -> None:
        self.round_number = round_number
        """0: the setup uploads before the first round."""
        self.client_ids: list[int] = []
        self._groups: dict[str, tuple[str, list[int]]] = {}
        """A reason with its client's id blanked out: (the reason as said of its first client, ids)."""

    def add_client(self, client_id: int, error: Exception) -> None:
        """One client's upload refused: ``error`` names the client ('client 3 sent ...')."""
        said = f"left client {client_id} out: {error}"
        self._add(re.sub(rf"\bclient {client_id}\b", "client #", said), said, [client_id])

    def add_rank(self, sender: str, client_ids: list[int], error: Exception) -> None:
        """A rank's message refused (``sender``: 'rank 2 (clients [...])'): its participants are out."""
        said = f"left out {sender}'s clients {client_ids}: {sender} {error}"
        self._add(said, said, client_ids)

    def _add(self, key: str, said: str, client_ids: list[int]) -> None:
        self.client_ids.extend(client_ids)
        self._groups.setdefault(key, (said, []))[1].extend(client_ids)

    def line(self) -> str | None:
        """The round's warning, or None when nobody was left out."""
        if not self._groups:
            return None
        groups = list(self._groups.values())
        parts = [said if len(ids) == 1 or said.startswith("left out ") else
                 f"{said}; likewise client{'s' if len(ids) > 2 else ''} {id_ranges(ids[1:])}"
                 for said, ids in groups[:SHOWN_REASONS]]
        rest = [cid for _, ids in groups[SHOWN_REASONS:] for cid in ids]
        if rest:
            parts.append(f"and clients {id_ranges(rest)} for {len(groups) - SHOWN_REASONS} other reason(s) "
                         f"(skipped_clients in metrics.jsonl)")
        when = "setup" if self.round_number == 0 else f"round {self.round_number}"
        return f"htfl_dist: warning: {when}: " + "; ".join(parts)

    def say(self) -> None:
        """Print the round's one warning line (nothing when nobody was left out)."""
        line = self.line()
        if line is not None:
            print(line, file=sys.stderr, flush=True)


def screen_uploads(uploads: dict[int, Payload], validate: Callable[[int, Payload], None], policy: str,
                   round_number: int, left_out: LeftOut | None = None) -> tuple[dict[int, Payload], list[int]]:
    """Split uploads into the valid ones and the ids of the clients left out. Those are added to
    ``left_out``, the round's record that its owner says once; without one they are said here."""
    record = left_out if left_out is not None else LeftOut(round_number)
    kept: dict[int, Payload] = {}
    skipped: list[int] = []
    for client_id, upload in uploads.items():
        try:
            check_finite(client_id, upload)
            validate(client_id, upload)
        except ProtocolError as exc:
            if policy == "fail":
                raise
            record.add_client(client_id, exc)
            skipped.append(client_id)
            continue
        kept[client_id] = upload
    if left_out is None:
        record.say()
    return kept, skipped


def unpack_rank_message(spec: PayloadSpec, message: Encoded, expected_ids: list[int]) -> dict[int, Payload]:
    """Decode one rank's message and check it holds exactly the clients that rank hosts and that
    take part this round, each once: a rank must not speak for another rank's clients (it would
    replace their uploads) nor for clients that do not exist. The error reads after the sender's
    name ("rank 2 (clients ...) sent ..."), which the caller builds only when there is one."""
    try:
        entries = decode(spec, message)
    except ProtocolError as exc:
        raise ProtocolError(f"sent a malformed message: {exc}") from None
    check_rank_entries(entries, expected_ids)
    return entries


def check_rank_entries(entries: dict[int, Payload], expected_ids: list[int]) -> None:
    """A rank's uploads are for exactly its participants (``unpack_rank_message``'s rule, also for
    the uploads that never left the process)."""
    if sorted(entries) != sorted(expected_ids):
        raise ProtocolError(f"sent uploads for clients {sorted(entries)}, "
                            f"expected its participants {sorted(expected_ids)}")


def check_rank_report(entries: dict[int, Payload], train_ids: list[int], eval_ids: list[int], *,
                      epsilon_budget: float | None = None) -> None:
    """A rank's end-of-round report (decoded, its rank row already taken out): training rows for
    exactly the participants it hosts, evaluation rows for exactly the clients it hosts (or none
    in a round without evaluation), and numbers that can be true: whole sample counts and
    0 <= correct <= samples (a loss may be NaN: training that diverged is real, and its upload is
    screened separately). Rank 0 pools these into the accuracy everybody reads; the error reads
    after the sender's name.

    A client's ε row (``privacy``: the ε it has spent, reported with privacy on) must be finite
    and >= 0, and, given ``epsilon_budget`` (``privacy.target_epsilon``), at most the budget: a
    ledger refuses any mechanism past it, so a larger ε is a lie or a broken ledger, and rank 0
    must not print it into metrics.jsonl as a private run's ε."""
    trained = sorted(cid for cid, entry in entries.items() if entry["train"].shape[0])
    evaluated = sorted(cid for cid, entry in entries.items() if entry["eval"].shape[0])
    if trained != sorted(train_ids) or evaluated != sorted(eval_ids):
        raise ProtocolError(f"reported training for clients {trained} and evaluation for {evaluated}, "
                            f"expected {sorted(train_ids)} and {sorted(eval_ids)}")
    for cid, entry in entries.items():
        for row in entry["train"]:
            _, samples = row.tolist()
            if not _is_count(samples):
                raise ProtocolError(f"reported an impossible training row for client {cid}: {row.tolist()}")
        for row in entry["eval"]:
            correct, correct_head, samples, *shares = row.tolist()  # shares: AUC and the weighted accuracies
            if not (_is_count(samples) and _is_count(correct) and _is_count(correct_head)
                    and correct <= samples and correct_head <= samples
                    and all(math.isnan(share) or 0 <= share <= 1 for share in shares)):
                raise ProtocolError(f"reported an impossible evaluation row for client {cid}: {row.tolist()} "
                                    f"(correct, correct by the head, samples, AUC, accuracy over the trained "
                                    f"classes, accuracy weighted by the training labels)")
        for row in entry.get("privacy", ()):
            _check_epsilon(cid, float(row[0]), epsilon_budget)


EPSILON_TOLERANCE = 1e-6
"""Relative slack on the budget: ε is computed by Opacus on every rank from the same history,
so an honest report is at most the target; the slack only absorbs float formatting."""


def _check_epsilon(client_id: int, epsilon: float, budget: float | None) -> None:
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ProtocolError(f"reported an impossible privacy ε for client {client_id}: {epsilon} "
                            f"(finite and >= 0)")
    if budget is not None and epsilon > budget * (1 + EPSILON_TOLERANCE):
        raise ProtocolError(f"reported privacy ε={epsilon:g} for client {client_id}, past "
                            f"privacy.target_epsilon={budget:g}, which its ledger never spends")


def check_rank_row(values: list[float]) -> None:
    """The rank's own row: compute seconds and theory bytes >= 0 and finite, stop flag 0 or 1."""
    seconds, theory_up, stop = values
    if not (math.isfinite(seconds) and seconds >= 0 and _is_count(theory_up) and stop in (0.0, 1.0)):
        raise ProtocolError(f"reported an impossible rank row {values} (compute seconds, theory bytes, stop)")


def _is_count(value: float) -> bool:
    return math.isfinite(value) and value >= 0 and value == int(value)
