"""What one input sample looks like: its kind and shape, as read from the data.

Every client model is built for the data it will see, so the data decides the input, never a
config key (only ``data.vocab_size`` may widen a text vocabulary). Three kinds:

* ``image``: float ``C x H x W`` arrays. Pictures (``3 x 32 x 32``) and sensor windows alike:
  PFLlib's HAR generator writes ``9 x 1 x 128`` (nine inertial signals, 128 time steps), its
  PAMAP2 generator ``9 x 3 x 256``; the models decide what they accept (image models square
  pictures, the HARCNN family nine-channel windows).
* ``text``: token ids padded to ``L``, and each sequence's length. One sample travels as one
  ``int64`` row of ``L + 1`` numbers, the ``L`` ids then the length, so batches are cut, moved and
  indexed like any other tensor; :func:`split_tokens` takes a batch apart again.
* ``tabular``: float feature vectors of width ``F`` (PFLlib's Amazon Review: 5000 word counts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

InputKind = Literal["image", "text", "tabular"]

INPUT_KINDS: tuple[str, ...] = ("image", "text", "tabular")


@dataclass(frozen=True)
class InputSpec:
    """One sample's kind and shape (``image``: (C, H, W); ``text``: (L,); ``tabular``: (F,)) and,
    for text, the vocabulary size (token ids lie in ``0 .. vocab_size - 1``)."""

    kind: InputKind
    shape: tuple[int, ...]
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"input kind {self.kind!r}; allowed: {', '.join(INPUT_KINDS)}")
        dims = 3 if self.kind == "image" else 1
        if len(self.shape) != dims or any(int(size) < 1 for size in self.shape):
            raise ValueError(f"{self.kind} input needs {dims} positive sizes, got {self.shape}")
        if self.kind == "text" and self.vocab_size < 1:
            raise ValueError(f"text input needs a positive vocab_size, got {self.vocab_size}")

    @classmethod
    def image(cls, in_channels: int, image_size: int) -> InputSpec:
        """Square pictures ``in_channels x image_size x image_size`` (what image configs give)."""
        return cls("image", (in_channels, image_size, image_size))

    @property
    def square(self) -> bool:
        return self.kind == "image" and self.shape[1] == self.shape[2]

    def describe(self) -> str:
        """How error lines and start-up lines name the data: '9 x 1 x 128 arrays', ..."""
        if self.kind == "text":
            return f"text (token ids padded to {self.shape[0]}, vocabulary {self.vocab_size})"
        if self.kind == "tabular":
            return f"tabular rows of {self.shape[0]} features"
        noun = "images" if self.square else "arrays"
        return f"{' x '.join(str(size) for size in self.shape)} {noun}"

    def example(self, batch: int = 1, device: torch.device | str = "cpu") -> Tensor:
        """A batch of valid inputs of zeros (text: all ids 0, every length L) for dry passes."""
        if self.kind == "text":
            rows = torch.zeros(batch, self.shape[0] + 1, dtype=torch.int64, device=device)
            rows[:, -1] = self.shape[0]
            return rows
        return torch.zeros(batch, *self.shape, device=device)


def split_tokens(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(token ids (B, L), lengths (B,))`` of a batch of text rows (see the module docstring)."""
    return rows[:, :-1], rows[:, -1]


__all__ = ["INPUT_KINDS", "InputKind", "InputSpec", "split_tokens"]
