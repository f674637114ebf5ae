"""What one training step sees and which samples each step takes: the batch record, the epoch's
sample order and the batch walk shared by the plain loop (``training.run_local_training``), the
batched clients' schedule (``training.group_schedule``) and DP-SGD (``privacy.dpsgd``).

A leaf: it imports nothing of htfl_dist, so the private loop can walk the same batches as the
plain one without importing the plain loop (and the plain loop need not know the private one)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: a leaf imports nothing of htfl_dist when it runs
    from htfl_dist.config import TrainConfig


@dataclass(frozen=True)
class Batch:
    """One training batch of a client and its model's outputs (features f_i(x), logits h_i(f_i(x)))."""

    x: torch.Tensor
    labels: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor | None = None
    """Per sample 1 (real) or 0 (padding) in a batched step (``run_batched_training``), whose
    batches all have ``train.batch_size`` rows; None: every row is a real sample. A loss must
    average over the real samples only (``batch_cross_entropy``, ``weighted_mean``)."""


def samples_per_epoch(count: int, train: TrainConfig) -> int:
    """How many of a client's ``count`` samples one local epoch trains on (the first ones of the
    epoch's order): all, less a trailing partial batch with ``last_batch=drop``, less a trailing
    batch of one sample otherwise (BatchNorm in the torchvision models cannot train on it; a
    client holding a single sample still trains on it)."""
    batch_size = train.batch_size
    used = count - count % batch_size if train.last_batch == "drop" else count
    if used > 1 and (used - 1) % batch_size == 0:
        used -= 1
    return used


def epoch_order(count: int, train: TrainConfig, generator: torch.Generator,
                device: torch.device | str) -> torch.Tensor | None:
    """One epoch's sample order: a fresh permutation drawn from ``generator``
    (``batch_order=shuffled``), or None for the stored order (``fixed``, which draws nothing)."""
    if train.batch_order == "fixed":
        return None
    return torch.randperm(count, generator=generator).to(device)


def epoch_batches(count: int, train: TrainConfig, generator: torch.Generator,
                  device: torch.device | str) -> Iterator[slice | torch.Tensor]:
    """The rows of every batch of ``train.local_epochs`` epochs over ``count`` samples, in
    training order: a slice of the stored order or a piece of the epoch's permutation.

    Lazy, so each epoch's permutation is drawn when its first batch is asked for, after the
    previous batch's step: a loss that draws from the same ``generator`` (FedKTL's pairs) sees
    the stream in the order a loop written out by hand would."""
    batch_size = train.batch_size
    used = samples_per_epoch(count, train)
    for _ in range(train.local_epochs):
        order = epoch_order(count, train, generator, device)
        for start in range(0, used, batch_size):
            stop = min(start + batch_size, used)
            yield slice(start, stop) if order is None else order[start:stop]
