"""The training loops algorithms share: a client's local SGD epoch(s), the same for a group of
same-architecture clients at once (``train.client_batching=vmap``), and the server's mini-batch
loop over (vector, label) pairs (FedTGP's prototypes, FedGH's head, FedOC)."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from htfl_dist.algorithms.batches import Batch, epoch_batches, epoch_order, samples_per_epoch
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState
from htfl_dist.algorithms.optimizers import check_round_learning_rate
from htfl_dist.algorithms.step_graphs import CudaGraphs, RecordedSteps, StepOutputs
from htfl_dist.config import TrainConfig
from htfl_dist.errors import ConfigError
from htfl_dist.models.base import SplitModel


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·v / Σ w over a batch's samples: the mean over the real samples of a padded batch
    (0 for a batch without any, the steps after a client's last)."""
    return (values * weights).sum() / weights.sum().clamp(min=1)


def batch_cross_entropy(batch: Batch) -> torch.Tensor:
    """CE(logits, labels) averaged over the batch's real samples (``F.cross_entropy`` itself
    when the batch has no padding)."""
    if batch.weights is None:
        return F.cross_entropy(batch.logits, batch.labels)
    return weighted_mean(F.cross_entropy(batch.logits, batch.labels, reduction="none"), batch.weights)


def gradient_clipper(parameters: Iterable[torch.Tensor], max_norm: float | None) -> Callable[[], None] | None:
    """A ``before_step`` for :func:`run_local_training` that clips the gradients of ``parameters``
    (together) to L2 norm ``max_norm``, as the reference codes' ``clip_grad_norm_`` before each
    step; None (no hook) when ``max_norm`` is None or not positive, the options' "off"."""
    if max_norm is None or max_norm <= 0:
        return None
    clipped, limit = list(parameters), max_norm

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(clipped, limit)

    return clip


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

    A private client (``client.private``, installed with its privacy ledger) trains the same
    epochs as DP-SGD through it; DP-SGD trains only the client's model with its own optimizer, so
    other optimizers and gradient edits are refused rather than left out.

    The client's optimizer is what ``train.optimizer`` names (``algorithms.optimizers``), at the
    round's learning rate, which the round loop set before the round (``begin_local_training``).
    """
    check_round_learning_rate(client, context.train)
    if client.private is not None:
        if optimizers is not None or before_step is not None:
            raise ConfigError(f"privacy.enabled: client {client.client_id}'s local training steps other modules "
                              f"or edits gradients, which DP-SGD does not cover")
        return client.private.train(client, context, loss_fn, generator, on_batch=on_batch)
    model = client.model
    steppers = (client.optimizer,) if optimizers is None else tuple(optimizers)
    model.train()
    full_batch_forward = model_forward(context.train.compile, client.device)

    def clear_gradients() -> None:
        for optimizer in steppers:
            optimizer.zero_grad(set_to_none=True)

    def update(x: torch.Tensor, y: torch.Tensor, forward: Callable = eager_forward) -> StepOutputs:
        """One step on a batch, gradients None when it starts (what a recorded step replays)."""
        features, logits = forward(model, x)
        loss = loss_fn(Batch(x, y, features, logits))
        loss.backward()
        if before_step is not None:
            before_step()
        for optimizer in steppers:
            optimizer.step()
        return loss.detach(), features.detach(), logits.detach()

    recorded = RecordedSteps(CudaGraphs(), update, clear_gradients) if context.step_graphs else None
    loss_total, seen = torch.zeros((), device=client.device), 0  # summed on device: no per-step sync
    for index in epoch_batches(client.train_y.shape[0], context.train, generator, client.device):
        x, y = client.train_x[index], client.train_y[index]
        full = y.shape[0] == context.train.batch_size
        outputs = None
        if recorded is not None and full:
            outputs = recorded_step(recorded, x, y, context)
            recorded = recorded if outputs is not None else None
        if outputs is None:
            clear_gradients()
            outputs = update(x, y, full_batch_forward if full else eager_forward)
        loss, features, logits = outputs
        if on_batch is not None:
            on_batch(Batch(x, y, features, logits))
        loss_total += loss * y.shape[0]
        seen += y.shape[0]
    return float(loss_total), seen


def recorded_step(recorded: RecordedSteps, x: torch.Tensor, y: torch.Tensor, context: AlgorithmContext
                  ) -> StepOutputs | None:
    """``recorded(x, y)``, or None where the step cannot be recorded (a host sync in the loss, an
    optimiser that is not capturable): nothing ran, the caller steps eagerly from here on, and the
    first such client says so in one line (``train.cuda_graphs=on`` makes it an error)."""
    try:
        return recorded(x, y)
    except RuntimeError as error:
        if recorded.replay is not None or recorded.static is None:
            raise  # not the recording: a real failure of the step
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if context.train.cuda_graphs == "on":
            raise ConfigError(f"train.cuda_graphs=on: the local step cannot be recorded as a CUDA graph "
                              f"({reason}); use train.cuda_graphs=auto or off") from None
        if not _SAID_UNRECORDABLE:
            print(f"train.cuda_graphs=auto: the local step cannot be recorded as a CUDA graph ({reason}); "
                  f"its clients train eagerly", file=sys.stderr, flush=True)
            _SAID_UNRECORDABLE.append(reason)
        return None


_SAID_UNRECORDABLE: list[str] = []
"""The reason given, once per process, for steps that could not be recorded."""


def eager_forward(model: SplitModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, logits) of ``x``: the forward pass every local step takes."""
    return model.forward_with_features(x)


_COMPILED_FORWARDS: dict[str, Callable[[SplitModel, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}
"""One compiled forward per ``train.compile`` mode for the whole process: Dynamo treats a
module's parameters as inputs, so every client of an architecture replays one graph (no
recompile per client), and each new architecture or batch shape adds one."""


COMPILED_GRAPHS = 64
"""Graphs the compiled forward may hold (architectures × batch shapes) before Dynamo gives up on it."""


def model_forward(mode: str, device: torch.device | str
                  ) -> Callable[[SplitModel, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The forward pass for full batches under ``train.compile=mode`` (:func:`eager_forward` when
    off). Under ``reduce-overhead`` on a GPU the outputs live in the CUDA graph's memory, which
    the next replay overwrites, so they are copied out (an algorithm may keep a batch's features
    past the step, FedProto's running means do)."""
    if mode == "off":
        return eager_forward
    if mode not in _COMPILED_FORWARDS:
        # one graph per architecture and batch shape: a group of 8+ members would otherwise pass
        # Dynamo's default of 8 graphs per function and fall back to eager with a warning
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPHS)
        _COMPILED_FORWARDS[mode] = torch.compile(eager_forward, mode=mode, dynamic=False)
    compiled = _COMPILED_FORWARDS[mode]
    if mode != "reduce-overhead" or torch.device(device).type != "cuda":
        return compiled

    def replayed(model: SplitModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.compiler.cudagraph_mark_step_begin()
        features, logits = compiled(model, x)
        return features.clone(), logits.clone()
    return replayed


# --------------------------------------------------------------------------- batched clients


@dataclass(frozen=True)
class GroupSchedule:
    """What every client of a group trains on at each batched step t: ``index`` [G, T, B] rows
    of the group's concatenated training splits, ``weights`` [G, T, B] 1 for a real sample and 0
    for padding (the rest of a partial batch, every row after the client's last step, which
    points at its first sample), ``steps`` each client's own number of steps (T is the largest)."""

    index: torch.Tensor
    weights: torch.Tensor
    steps: list[int]
    samples: list[int]
    """What ``run_local_training`` reports as seen: local epochs × samples per epoch."""


def group_schedule(clients: Sequence[ClientState], train: TrainConfig,
                   generators: Sequence[torch.Generator]) -> GroupSchedule:
    """Each client's batches exactly as ``run_local_training`` walks them (its own
    ``epoch_order`` drawn from its own generator, ``samples_per_epoch``), laid out step by step
    and padded to one shape, on the CPU."""
    batch_size = train.batch_size
    per_client, samples, offset = [], [], 0
    for client, generator in zip(clients, generators, strict=True):
        count = client.train_y.shape[0]
        used = samples_per_epoch(count, train)
        padded = -(-used // batch_size) * batch_size
        epochs = []
        for _ in range(train.local_epochs):
            order = epoch_order(count, train, generator, "cpu")
            order = torch.arange(count) if order is None else order
            epochs.append(F.pad(order[:used] + offset, (0, padded - used), value=-1))
        per_client.append(torch.cat(epochs).view(-1, batch_size))
        samples.append(used * train.local_epochs)
        offset += count
    steps = [rows.shape[0] for rows in per_client]
    index = torch.stack([F.pad(rows, (0, 0, 0, max(steps) - rows.shape[0]), value=-1) for rows in per_client])
    real = index >= 0
    firsts = torch.tensor([0] + [client.train_y.shape[0] for client in clients[:-1]]).cumsum(0)
    return GroupSchedule(torch.where(real, index, firsts.view(-1, 1, 1)), real.float(), steps, samples)


class _FeaturesAndLogits(nn.Module):
    """``model.forward_with_features`` as a module's forward, for ``functional_call``."""

    def __init__(self, model: SplitModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_with_features(x)


def plain_sgd_rate(clients: Sequence[ClientState]) -> float:
    """The learning rate of the group's optimizers, which must be one plain SGD (no momentum,
    weight decay, dampening, Nesterov or maximize) over each client's model parameters, all with
    the same rate: the batched step implements p ← p − lr·g and nothing else, and keeps no
    optimizer state. Anything else is refused rather than trained differently (``train.check``
    refuses such a config at load). The rate is the round's (``train.lr_schedule``)."""
    rates = set()
    for client in clients:
        optimizer = client.optimizer
        groups = optimizer.param_groups
        plain = (type(optimizer) is torch.optim.SGD and len(groups) == 1
                 and not any(groups[0].get(key) for key in ("momentum", "weight_decay", "dampening",
                                                              "nesterov", "maximize"))
                 and [id(p) for p in groups[0]["params"]] == [id(p) for p in client.model.parameters()])
        if not plain:
            raise ConfigError(f"train.client_batching=vmap: client {client.client_id}'s optimizer is not plain SGD "
                              f"over its model ({type(optimizer).__name__}); the batched step implements only that; "
                              f"use train.client_batching=off")
        rates.add(groups[0]["lr"])
    if len(rates) != 1:
        raise ConfigError(f"train.client_batching=vmap: a group's clients train with different learning rates "
                          f"{sorted(rates)}; use train.client_batching=off")
    return rates.pop()


def run_batched_training(clients: Sequence[ClientState], context: AlgorithmContext,
                         loss_fn: Callable[[Batch], torch.Tensor], generators: Sequence[torch.Generator], *,
                         on_batch: Callable[[Batch], None] | None = None) -> list[tuple[float, int]]:
    """``run_local_training`` for a group of clients of one architecture, as one batched model:
    their parameters stacked (``stack_module_state``), each step one ``vmap(grad(...))`` over the
    group of ``functional_call``s and one SGD update of every stacked parameter.

    Each client walks its own batches (``group_schedule``: its permutations from its own
    generator, its own step count); a partial batch is padded to ``train.batch_size`` with
    weight-0 rows, and ``loss_fn`` (the same function for every client, so a client's result
    does not depend on its group) must average over the real samples (``Batch.weights``). A
    client whose steps are over takes no part in the later steps (no update and no compute: the
    group is ranked by step count and each step runs on the prefix still training; Dirichlet
    splits make step counts very unequal). ``on_batch`` sees each step's detached outputs before
    the update, with a leading group dimension in the clients' order: x [G, B, ...], labels,
    weights [G, B] (0 for padding and finished clients), features [G, B, K], logits [G, B, C].
    The trained parameters are
    written back into each client's model; momentum-free SGD has no optimizer state to keep
    (``plain_sgd_rate`` refuses anything else). Nothing draws from torch's global RNG: vmap
    raises on random operations. Returns (loss sum, samples) per client, as
    ``run_local_training`` would."""
    for client in clients:
        check_round_learning_rate(client, context.train)
    rate = plain_sgd_rate(clients)
    schedule = group_schedule(clients, context.train, generators)
    device = clients[0].device
    # longest first, so the clients still training at any step are a prefix: slicing the stacked
    # parameters (views) leaves the finished ones out of the step, which is their mask
    ranked = sorted(range(len(clients)), key=lambda g: -schedule.steps[g])
    params, buffers = _stacked_state([clients[g] for g in ranked])
    index, weights = schedule.index[ranked].to(device), schedule.weights[ranked].to(device)
    positions = torch.tensor(ranked, device=device)
    steps = [schedule.steps[g] for g in ranked]
    train_x = torch.cat([client.train_x for client in clients])
    train_y = torch.cat([client.train_y for client in clients])
    base = _FeaturesAndLogits(clients[0].model)

    def objective(state: dict, state_buffers: dict, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
        features, logits = functional_call(base, (state, state_buffers), (x,))
        loss = loss_fn(Batch(x, y, features, logits, w))
        return loss, (loss, features, logits)

    step = vmap(grad(objective, has_aux=True))
    for client in clients:
        client.model.train()
    loss_total = torch.zeros(len(clients), device=device)
    with torch.no_grad():
        for t in range(steps[0]):
            active = sum(count > t for count in steps)
            state = {name: tensor[:active] for name, tensor in params.items()}
            rows, w = index[:active, t], weights[:active, t]
            x, y = train_x[rows], train_y[rows]
            grads, (loss, features, logits) = step(state, {n: b[:active] for n, b in buffers.items()}, x, y, w)
            torch._foreach_add_(list(state.values()), [grads[name] for name in state], alpha=-rate)
            if on_batch is not None:
                on_batch(_in_client_order(Batch(x, y, features, logits, w), positions[:active], len(clients)))
            loss_total[:active] += loss * w.sum(dim=1)
        for rank, g in enumerate(ranked):
            for name, parameter in clients[g].model.named_parameters():
                parameter.copy_(params[f"model.{name}"][rank])
    totals = [0.0] * len(clients)
    for rank, g in enumerate(ranked):
        totals[g] = float(loss_total[rank])
    return list(zip(totals, schedule.samples, strict=True))


def _stacked_state(clients: Sequence[ClientState]) -> tuple[dict, dict]:
    """The clients' parameters and buffers stacked along a new leading dimension, named as in
    ``_FeaturesAndLogits`` (copies: the step updates them, the models get them back at the end)."""
    params, buffers = stack_module_state([client.model for client in clients])
    return ({f"model.{name}": tensor.detach() for name, tensor in params.items()},
            {f"model.{name}": tensor for name, tensor in buffers.items()})


def _in_client_order(batch: Batch, positions: torch.Tensor, groups: int) -> Batch:
    """A step's outputs for the clients still training (rows ``positions``) spread over all
    ``groups`` clients in their order; the others get weight-0 rows."""
    def spread(tensor: torch.Tensor) -> torch.Tensor:
        full = tensor.new_zeros((groups, *tensor.shape[1:]))
        full[positions] = tensor
        return full

    assert batch.weights is not None  # a batched step's batch always carries its padding weights
    return Batch(*(spread(tensor) for tensor in (batch.x, batch.labels, batch.features, batch.logits, batch.weights)))


def batching_obstacle(model: nn.Module) -> str | None:
    """What keeps a model from training batched, or None: BatchNorm (its training-mode output
    depends on the whole batch, padding rows included, and it updates running statistics) or
    Dropout (per-client random streams that vmap cannot draw); an InstanceNorm that keeps
    running statistics too."""
    for name, module in model.named_modules():
        batch_statistics = isinstance(module, nn.modules.batchnorm._BatchNorm) or (
            isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats)
        if batch_statistics or isinstance(module, nn.modules.dropout._DropoutNd):
            return f"a {type(module).__name__} layer ({name})"
    return None


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
