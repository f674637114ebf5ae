"""Payload types: what an algorithm declares it sends, and what the runtime moves.

A neutral module that both layers import: algorithms declare their payloads with these types
and never import the runtime; the runtime's wire format (``runtime/wire.py``) encodes them.

A payload is a dict of tensors. Its declaration is an ordered tuple of ``Field`` (name, dtype,
trailing shape); only the leading dimension (rows, e.g. "the classes this client holds")
varies from message to message. Model parts that an algorithm shares (a head, a shared model,
a generator) are declared the same way, as one row of a flattened parameter vector.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Field:
    """One declared tensor of a payload: ``rows × trailing_shape`` of ``dtype``."""

    name: str
    dtype: torch.dtype
    trailing_shape: tuple[int, ...] = ()
    max_rows: int | None = None
    """The most rows one entry can truthfully carry (a class-indexed field: C; a parameter row: 1).
    Rank 0 bounds what it accepts from a rank by it before allocating; None: only by
    ``runtime.max_message_mb``."""

    def row_numel(self) -> int:
        numel = 1
        for size in self.trailing_shape:
            numel *= size
        return numel

    def row_bytes(self) -> int:
        return self.row_numel() * torch.empty((), dtype=self.dtype).element_size()


def max_message_bytes(spec: tuple[Field, ...], entries: int) -> int | None:
    """The largest encoded message (header and body, see ``runtime/wire.py``) that ``entries``
    entries of ``spec`` can make, or None when a field declares no ``max_rows``."""
    entry_bytes = 0
    for field in spec:
        if field.max_rows is None:
            return None
        entry_bytes += field.max_rows * field.row_bytes()
    header_values = 1 + entries * (1 + len(spec))
    return header_values * 8 + entries * entry_bytes


PayloadSpec = tuple[Field, ...]
Payload = dict[str, torch.Tensor]
