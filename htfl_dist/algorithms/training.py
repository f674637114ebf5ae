"""The two training loops algorithms share: a client's local SGD epoch(s), and the server's
mini-batch loop over (vector, label) pairs (FedTGP's prototypes, FedGH's head, FedOC)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from htfl_dist.algorithms.interface import AlgorithmContext, ClientState


@dataclass(frozen=True)
class Batch:
    """One training batch of a client and its model's outputs (features f_i(x), logits h_i(f_i(x)))."""

    x: torch.Tensor
    labels: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor


def run_local_training(client: ClientState, context: AlgorithmContext,
                       loss_fn: Callable[[Batch], torch.Tensor], generator: torch.Generator, *,
                       on_batch: Callable[[Batch], None] | None = None,
                       optimizers: Sequence[torch.optim.Optimizer] | None = None,
                       before_step: Callable[[], None] | None = None) -> tuple[float, int]:
    """SGD over the client's training split for ``train.local_epochs`` epochs.

    ``loss_fn(batch)`` is the algorithm's objective; it may run other modules (a shared model,
    a generator) on ``batch.x``. ``optimizers`` (default: the client's own) all step after one
    backward pass, after ``before_step`` (e.g. gradient clipping). ``on_batch`` sees every batch
    with detached outputs, taken before the step (FedProto's and FedDistill's running means).
    ``train.batch_order=shuffled`` (default) permutes the split afresh every epoch with
    ``generator`` (derived from seed, client id and round by the runtime), so the sample order
    does not depend on where the client runs; ``fixed`` keeps the split's stored order and draws
    nothing from ``generator``. ``train.last_batch=keep`` (default) trains the trailing partial
    batch unless it holds a single sample (BatchNorm in the torchvision models cannot train on
    it); ``drop`` leaves every trailing partial batch out (HtFLlib's ``drop_last=True``).
    Returns (sum of batch losses × batch size, samples).
    """
    model = client.model
    optimizers = (client.optimizer,) if optimizers is None else tuple(optimizers)
    train = context.train
    batch_size = train.batch_size
    count = client.train_y.shape[0]
    end = count - count % batch_size if train.last_batch == "drop" else count
    model.train()
    loss_total, seen = torch.zeros((), device=client.device), 0  # summed on device: no per-step sync
    for _ in range(train.local_epochs):
        order = None if train.batch_order == "fixed" else torch.randperm(count, generator=generator).to(client.device)
        for start in range(0, end, batch_size):
            if end - start == 1 and start > 0:
                break  # a final batch of one sample breaks BatchNorm on 1×1 maps; skip it
            index = slice(start, start + batch_size) if order is None else order[start : start + batch_size]
            x, y = client.train_x[index], client.train_y[index]
            features, logits = model.forward_with_features(x)
            loss = loss_fn(Batch(x, y, features, logits))
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if before_step is not None:
                before_step()
            for optimizer in optimizers:
                optimizer.step()
            if on_batch is not None:
                on_batch(Batch(x, y, features.detach(), logits.detach()))
            loss_total += loss.detach() * y.shape[0]
            seen += y.shape[0]
    return float(loss_total), seen


def train_on_pairs(rows: torch.Tensor, labels: torch.Tensor,
                   loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer, *,
                   epochs: int, batch_size: int, generator: torch.Generator,
                   per_pair: Sequence[torch.Tensor] = (),
                   before_step: Callable[[], None] | None = None,
                   skip_single: bool = False) -> float:
    """``epochs`` of shuffled mini-batch steps on (row, label) pairs; returns the last epoch's mean
    loss. ``loss_fn(batch_rows, batch_labels, *batch_per_pair)``; ``per_pair`` are extra tensors
    with one row per pair, shuffled with them (FedTGP's margin offsets). The last batch may be
    smaller (``drop_last=False``, as the reference servers do); ``skip_single`` leaves out a batch
    of one pair, on which a BatchNorm layer cannot train (FedKTL's F; HtFLlib drops it too).
    ``before_step`` runs between backward and step (gradient clipping).

    The step count can be large (FedTGP: S · ⌈pairs / batch⌉ ≈ 1000) and on a GPU each step is
    bound by kernel launches, so per-step work is kept to the model and its loss: each epoch's
    shuffle is drawn up front and applied once (batches are views), and the loss is accumulated
    only in the reported epoch."""
    device = rows.device
    count = rows.shape[0]
    orders = torch.stack([torch.randperm(count, generator=generator) for _ in range(epochs)]).to(device)
    last_epoch = epochs - 1
    epoch_loss = torch.zeros((), device=device)
    for epoch, order in enumerate(orders):
        epoch_rows, epoch_labels = rows[order], labels[order]
        epoch_extra = [tensor[order] for tensor in per_pair]
        for start in range(0, count, batch_size):
            batch = slice(start, start + batch_size)
            if skip_single and count - start == 1:
                break
            loss = loss_fn(epoch_rows[batch], epoch_labels[batch], *(t[batch] for t in epoch_extra))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            if epoch == last_epoch:
                epoch_loss += loss.detach() * epoch_labels[batch].shape[0]
    return float(epoch_loss) / count
