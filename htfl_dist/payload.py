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

    def row_numel(self) -> int:
        numel = 1
        for size in self.trailing_shape:
            numel *= size
        return numel

    def row_bytes(self) -> int:
        return self.row_numel() * torch.empty((), dtype=self.dtype).element_size()


PayloadSpec = tuple[Field, ...]
Payload = dict[str, torch.Tensor]
