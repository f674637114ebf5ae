"""DP-SGD local training: the client's own loop (the batches of ``batches.epoch_batches``, which
``training.run_local_training`` walks too: the same epochs, permutations and trailing-batch
rule), each step's gradient replaced by Opacus's clipped and noised per-sample sum.

Per-sample gradients come from ``torch.func`` (``vmap`` of ``grad`` over single-sample batches)
rather than Opacus's layer hooks: an algorithm's loss may couple a batch's samples (FedProto's
regulariser compares batch class means with the global prototypes), and a hook's per-sample
share of a coupled loss depends on the other samples, which breaks the clipping bound. Evaluated
on one sample at a time, any loss is a per-sample loss, so the clipped gradients are bounded by
construction; the step then minimises the mean of the per-sample losses. Opacus's
``DPOptimizer`` clips, sums, adds the noise (from the source the ledger hands out for this round's
DP-SGD, ``privacy.noise``: the OS's secure generator by default) and scales; the wrapped optimizer
steps as usual.

The whole loss runs inside the ``functional_call``: a loss that calls the client's model itself
(FedSA's calibration term sends the anchors through the head, FedKTL's transfer term sends the
downloaded images through the feature extractor) differentiates the same weights as the batch's
forward pass, instead of constants that would silently drop its gradient.

A *public* term (``public_loss``) is one computed from no training sample: downloaded data and
the current model only (FedKTL's image–latent pairs). Given the model, which is itself the
output of the earlier private steps, its gradient reveals nothing more about the samples, so it
is added after the noise, unclipped, as post-processing; it may also train modules of its own
(``public_optimizers``, FedKTL's h′), and ``before_step`` may edit the summed gradient (the
post-processing argument again).

Noise: under the neighbouring relation of docs/privacy.md (one sample's input replaced) the sum
of clipped gradients moves by at most 2·C, so the noise standard deviation is σ·2·C, i.e.
Opacus's ``noise_multiplier`` (std / C) is 2σ. Each local epoch visits each sample in exactly
one batch, so an epoch is one Gaussian mechanism of multiplier σ (composed adaptively over its
steps, only one of which sees the replaced sample); no amplification by subsampling is claimed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import nn
from torch.func import functional_call, grad, vmap

from htfl_dist.algorithms.batches import Batch, epoch_batches
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState
from htfl_dist.errors import ConfigError
from htfl_dist.models.base import SplitModel
from htfl_dist.privacy.accounting import PrivacyLedger
from htfl_dist.privacy.noise import NoiseSource


def check_private_optimizer(client: ClientState) -> None:
    """DP-SGD clips the gradients of the client's model parameters only: its optimizer must
    update exactly those (an algorithm that steps other modules from the private data is refused
    at start-up; this guards the loop itself)."""
    optimised = [id(p) for group in client.optimizer.param_groups for p in group["params"]]
    trainable = [id(p) for p in client.model.parameters() if p.requires_grad]
    if sorted(optimised) != sorted(trainable):
        raise ConfigError(f"privacy.enabled: client {client.client_id}'s optimizer does not update exactly its "
                          f"model's parameters, which DP-SGD needs")


class _SourcedDPOptimizer(DPOptimizer):
    """Opacus's ``DPOptimizer`` whose Gaussian noise comes from a ``NoiseSource`` (the ledger's
    for this round) instead of a torch generator: a torch generator is a seeded stream, and the
    default noise must be one no other party can reproduce. Clipping, summing and scaling stay
    Opacus's."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise: NoiseSource, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.noise = noise

    def add_noise(self) -> None:
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            draws = self.noise.standard_normal(p.summed_grad.shape, dtype=p.summed_grad.dtype,
                                               device=p.summed_grad.device)
            p.grad = (p.summed_grad + std * draws).view_as(p)
            _mark_as_processed(p.summed_grad)


class _SampleObjective(nn.Module):
    """The model's forward pass and the algorithm's loss as one module's forward, so that
    ``functional_call`` swaps the model's weights for the differentiated ones during the loss
    too (a loss may call the model's parts itself)."""

    def __init__(self, model: SplitModel, loss_fn: Callable[[Batch], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, logits = self.model.forward_with_features(x)
        return self.loss_fn(Batch(x, y, features, logits)), features, logits


def train_privately(client: ClientState, context: AlgorithmContext, loss_fn: Callable[[Batch], torch.Tensor],
                    generator: torch.Generator, ledger: PrivacyLedger, *,
                    on_batch: Callable[[Batch], None] | None = None,
                    public_loss: Callable[[], torch.Tensor] | None = None,
                    public_optimizers: Sequence[torch.optim.Optimizer] = (),
                    before_step: Callable[[], None] | None = None) -> tuple[float, int]:
    """``train.local_epochs`` epochs of DP-SGD over the client's training split; returns (sum of
    the per-sample losses, plus ``public_loss`` × batch size, samples) as ``run_local_training``
    does. A client the ledger has stopped does not train (0, 0).

    ``public_loss()`` (once per step, after ``loss_fn``) must not read the training split: its
    gradient is added to the noised one, and ``public_optimizers`` step the other modules it
    trains; ``before_step`` runs on the finished gradients (module docstring)."""
    if not ledger.active:
        return 0.0, 0
    check_private_optimizer(client)
    model, train = client.model, context.train
    plan = ledger.plan
    noise = ledger.open_mechanism("sgd")  # before any step: a refused mechanism leaves the model untouched
    optimizer = _SourcedDPOptimizer(client.optimizer, noise=noise, noise_multiplier=2.0 * ledger.noise_multiplier,
                                    max_grad_norm=plan.max_grad_norm, expected_batch_size=train.batch_size)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    parameters = [p for _, p in model.named_parameters() if p.requires_grad]
    buffers = {f"model.{name}": b for name, b in model.named_buffers()}
    objective = _SampleObjective(model, loss_fn)

    def sample_loss(weights: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor):
        state = {f"model.{name}": w for name, w in zip(names, weights, strict=True)}
        loss, features, logits = functional_call(objective, (state, buffers), (x.unsqueeze(0), y.unsqueeze(0)))
        return loss, (loss, features.squeeze(0), logits.squeeze(0))

    per_sample = vmap(grad(sample_loss, has_aux=True), in_dims=(None, 0, 0), randomness="different")
    model.train()
    loss_total, seen = torch.zeros((), device=client.device), 0
    try:
        for index in epoch_batches(client.train_y.shape[0], train, generator, client.device):
            x, y = client.train_x[index], client.train_y[index]
            grads, (losses, features, logits) = per_sample(tuple(p.detach() for p in parameters), x, y)
            for parameter, sample_grads in zip(parameters, grads, strict=True):
                # Opacus's optimizer reads per-sample gradients from this attribute it adds to Parameter
                parameter.grad_sample = sample_grads  # type: ignore[attr-defined]
            optimizer.expected_batch_size = y.shape[0]  # the mean over this batch's samples
            public = _private_step(optimizer, public_loss, public_optimizers, before_step)
            if public is not None:
                loss_total += public * y.shape[0]
            if on_batch is not None:
                on_batch(Batch(x, y, features.detach(), logits.detach()))
            loss_total += losses.detach().sum()
            seen += y.shape[0]
    finally:
        for parameter in parameters:  # Opacus's per-step attributes: nothing of them outlives the loop
            for attribute in ("grad_sample", "summed_grad", "_processed"):
                if hasattr(parameter, attribute):
                    delattr(parameter, attribute)
    return float(loss_total), seen


def _private_step(optimizer: DPOptimizer, public_loss: Callable[[], torch.Tensor] | None,
                  public_optimizers: Sequence[torch.optim.Optimizer],
                  before_step: Callable[[], None] | None) -> torch.Tensor | None:
    """One step: the clipped, noised, averaged per-sample gradient (``pre_step``), plus the public
    term's gradient, then every optimizer. Returns the public loss (detached) if there is one."""
    for other in public_optimizers:
        other.zero_grad(set_to_none=True)
    optimizer.pre_step()  # p.grad = (Σ clipped + noise) / B for every model parameter
    value = None
    if public_loss is not None:
        loss = public_loss()
        loss.backward()  # adds into p.grad: post-processing of the private model
        value = loss.detach()
    if before_step is not None:
        before_step()
    optimizer.original_optimizer.step()
    for other in public_optimizers:
        other.step()
    optimizer.zero_grad(set_to_none=True)
    return value
