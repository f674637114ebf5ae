"""Server-side screening of uploads before the algorithm sees them (docs/architecture.md).

A bad upload (NaN/Inf values, class ids out of range, ...) is normal input in a long run with
many clients: by default the client is left out of that round with a warning naming it and the
run goes on (``on_bad_upload: skip``); ``on_bad_upload: fail`` ends the job instead.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.wire import Encoded, Payload, PayloadSpec, decode


def check_finite(client_id: int, upload: Payload) -> None:
    for name, tensor in upload.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"client {client_id} sent NaN/Inf values in '{name}': its local training "
                                f"diverged (lower train.lr or algo.reg_weight)")


def screen_uploads(uploads: dict[int, Payload], validate: Callable[[int, Payload], None], policy: str,
                   round_number: int) -> tuple[dict[int, Payload], list[int]]:
    """Split uploads into the valid ones and the ids of the clients left out."""
    kept: dict[int, Payload] = {}
    skipped: list[int] = []
    for client_id, upload in uploads.items():
        try:
            check_finite(client_id, upload)
            validate(client_id, upload)
        except ProtocolError as exc:
            if policy == "fail":
                raise
            print(f"htfl_dist: warning: round {round_number}: left client {client_id} out: {exc}",
                  file=sys.stderr, flush=True)
            skipped.append(client_id)
            continue
        kept[client_id] = upload
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
    if sorted(entries) != sorted(expected_ids):
        raise ProtocolError(f"sent uploads for clients {sorted(entries)}, "
                            f"expected its participants {sorted(expected_ids)}")
    return entries


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
            correct, correct_head, samples = row.tolist()
            if not (_is_count(samples) and _is_count(correct) and _is_count(correct_head)
                    and correct <= samples and correct_head <= samples):
                raise ProtocolError(f"reported an impossible evaluation row for client {cid}: {row.tolist()} "
                                    f"(correct, correct by the head, samples)")
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
