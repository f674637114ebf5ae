"""Server-side screening of uploads before the algorithm sees them (DESIGN.md contract 7).

A bad upload (NaN/Inf values, class ids out of range, ...) is normal input in a long run with
many clients: by default the client is left out of that round with a warning naming it and the
run goes on (``on_bad_upload: skip``); ``on_bad_upload: fail`` ends the job instead.
"""
from __future__ import annotations

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
