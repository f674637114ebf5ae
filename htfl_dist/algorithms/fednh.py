"""FedNH (Dai, Chen, Chen, Yang and Zhang, AAAI 2023): class prototypes spread uniformly on the
unit sphere, with class semantics infused slowly (docs/algorithms.md, "FedNH").

The server holds one unit prototype P^c ∈ R^K per class, spread over the unit sphere before the
first round (``init``). Clients classify their normalised features against the fixed prototypes,

    logits_c = s_i · ⟨f(x)/‖f(x)‖, P^c⟩                     (cosine classifier, s_i the scale)

train CE on those logits, and upload, for each class they hold, the mean of their normalised
features μ_i^c = (1/n_i^c) Σ_{y=c} f(x)/‖f(x)‖ with its count n_i^c. The server averages them
per class, weighted by the counts, and smooths the result into the prototypes:

    a^c = Σ_i n_i^c μ_i^c / Σ_i n_i^c,   P^c ← (ρ·P^c + (1 − ρ)·a^c) / ‖ρ·P^c + (1 − ρ)·a^c‖

for the classes uploaded this round (ρ = 0.9); the others keep P^c. A client predicts the class
of the largest s_i·cosine. FedNH also averages the clients' backbones (FedAvg); with one model
architecture per client there is nothing to average, so only the prototypes travel and every
backbone, and its scale s_i, stays on its client (the heterogeneous-model adaptation).

The equations above are the paper's as recalled (its method section could not be read, issue
47), so the defaults follow the one source that could be read, the reference code
(Yutong-Dai/FedNH@60c3161, ``compat=reference``): ``init=orthogonal`` (Haar-random orthonormal rows
instead of a spread that maximises the smallest angle), ``normalise_client_means`` and
``normalise_aggregate`` (μ_i^c and a^c put on the sphere before weighting and before smoothing),
``clip_grad_norm=10`` (every local step's gradient clipped), and a client scored with the
prototypes it trained against (``eval_prototypes=trained``). ``compat=paper`` runs the equations.
Its CNN's scale starts at 1 and is learnt (``scale``, ``learn_scale``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    check_class_counts,
    check_class_rows,
    class_means,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.fedproto import prototype_fields
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.optimizers import companion_optimizer
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import Batch, batch_cross_entropy, gradient_clipper, run_local_training
from htfl_dist.config import bounded
from htfl_dist.config.rules import Identity, declared
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

Init = Literal["spread", "orthogonal"]
EvalPrototypes = Literal["trained", "updated"]
SCALE_MODULE = "fednh_scale"
"""The key of a client's scale s_i among ``ClientState.modules`` (checkpointed with the client)."""
TRAINED_MODULE = "fednh_trained_prototypes"
"""The key of the prototypes a client last trained against (``eval_prototypes=trained``), kept
among its modules so that a checkpoint and a parked client keep them too."""
NORM_FLOOR = 1e-12
"""‖v‖ is floored here before a division (the reference code's clamp)."""


REFERENCE_CLIP_GRAD_NORM = 10.0
"""Yutong-Dai/FedNH clips every local step's gradient at norm 10 (its client's ``clip_grad_norm_``)."""


@dataclass
class FedNHOptions:
    compat: Compat = compat_option(added_later=True, default="reference")
    """reference (default; issue 47: the code is the one source that could be read): every knob
    left unset takes the code's value (Yutong-Dai/FedNH@60c3161, ``src/flbase/strategies``):
    init=orthogonal (``FedUH.py:FedUHClient._initialize_model``), normalise_client_means=true
    (``FedNH.py:FedNHClient._estimate_prototype``), normalise_aggregate=true
    (``FedNH.py:FedNHServer.aggregate``), clip_grad_norm=10 (``FedUH.py:FedUHClient.training``).
    paper: the paper's equations as recalled, not read (a uniform spread, plain means, no
    clipping): spread, false, false, no clipping; what this engine ran before issue 47, so those
    runs keep their hash under it."""
    smoothing: float = bounded(0.9, at_least=0, at_most=1)
    """ρ: the share of the old prototype kept each round (1: the prototypes never move)."""
    init: Init | None = None
    """spread: a uniform draw on the sphere, then ``init_steps`` projected gradient steps that
    lower the largest pairwise cosine (the paper's prototypes spread uniformly, its smallest angle
    made as large as it can be; :func:`spread_on_sphere`); orthogonal: Haar-random orthonormal
    rows (the reference code's ``torch.nn.init.orthogonal_``), put on the sphere where C > K
    leaves them shorter."""
    init_steps: int = bounded(1000, at_least=0)
    """Projected gradient steps of ``init=spread`` (0: the uniform draw alone)."""
    init_lr: float = bounded(0.1, above=0)
    """η, their step size."""
    init_momentum: float = bounded(0.9, at_least=0, below=1)
    """μ, their momentum."""
    init_temperature: float = bounded(10.0, above=0)
    """τ of the smooth maximum they lower (larger: closer to the largest cosine itself)."""
    scale: float = bounded(1.0, above=0)
    """s_i's value at the start (the reference CNN's 1; its fixed-scale runs use 30)."""
    learn_scale: bool = True
    """Train s_i with the backbone, at the client's learning rate (False: s_i stays ``scale``)."""
    normalise_client_means: bool | None = None
    """Upload μ_i^c/‖μ_i^c‖ instead of μ_i^c (the reference code's)."""
    normalise_aggregate: bool | None = None
    """Put a^c on the sphere before it is smoothed in (the reference code's)."""
    clip_grad_norm: float | None = bounded(None, at_least=0, optional=True,
                                           note="0: no clipping; null: the compat preset's")
    """Clip each local step's gradient (backbone and s_i together) to this L2 norm (the reference
    code clips at 10); 0 or, under compat=paper, unset: no clipping."""
    eval_prototypes: EvalPrototypes = declared("trained", identity=Identity(added_later=True, before="updated"))
    """The prototypes a client is scored with. trained: those it last trained against, as the
    reference code scores each client (Yutong-Dai/FedNH@60c3161, ``strategies/FedAvg.py:
    FedAvgServer.run`` sets each active client's model, prototypes included, before training and
    tests it after ``aggregate`` with ``FedUH.py:FedUHClient.testing``, i.e. on its own copy);
    a client that has not trained yet uses the evaluation's download. updated: this round's, after
    the server's update (this engine's rule before issue 47, from no source; left out of the hash
    so those runs resume). Not a preset knob: the code's protocol is the only one known."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.init is None:
            self.init = "orthogonal" if reference else "spread"
        if self.normalise_client_means is None:
            self.normalise_client_means = reference
        if self.normalise_aggregate is None:
            self.normalise_aggregate = reference
        if self.clip_grad_norm is None and reference:
            self.clip_grad_norm = REFERENCE_CLIP_GRAD_NORM



# ------------------------------------------------------------------------------ the spread

def largest_cosines(units: torch.Tensor) -> torch.Tensor:
    """Per row of unit rows [C, K]: the largest cosine to any other row, [C]."""
    cosines = units @ units.t()
    cosines = cosines - 2.0 * torch.eye(units.shape[0], dtype=units.dtype)  # a row is never its own rival
    return cosines.max(dim=1).values


def smooth_max_gradient(units: torch.Tensor, temperature: float) -> torch.Tensor:
    """∂L/∂P for L = (1/τ)·log Σ_{i≠j} exp(τ·⟨P^i, P^j⟩), the smooth maximum of the pairwise
    cosines of unit rows [C, K]: ∂L/∂P^i = 2·Σ_{j≠i} w_ij·P^j, w the softmax of τ·cos over the
    ordered pairs (symmetric, hence the 2)."""
    count = units.shape[0]
    off_diagonal = ~torch.eye(count, dtype=torch.bool)
    logits = (temperature * (units @ units.t())).masked_fill(~off_diagonal, float("-inf"))
    weights = torch.softmax(logits.flatten(), dim=0).view(count, count)
    return 2.0 * weights @ units


def spread_on_sphere(draw: torch.Tensor, steps: int, lr: float, momentum: float, temperature: float) -> torch.Tensor:
    """From the rows of ``draw`` put on the sphere, ``steps`` of gradient descent with momentum
    (v ← μ·v + ∇L, P ← (P − η·v)/‖P − η·v‖ row-wise) on the smooth maximum of the pairwise
    cosines (:func:`smooth_max_gradient`): the largest cosine falls, the smallest angle grows.
    For C ≤ K + 1 the minimiser is the regular simplex (every cosine −1/(C−1)) at any τ, since
    Σ exp(τ·cos) ≥ C(C−1)·exp(τ·mean cos) and Σ_{i≠j} cos ≥ −C; above it, τ → ∞ is the
    smallest-angle (Tammes) problem. In float64; returns float32 unit rows."""
    units = F.normalize(draw.double(), dim=1, eps=NORM_FLOOR)
    if units.shape[0] < 2:
        return units.float()
    velocity = torch.zeros_like(units)
    for _ in range(steps):
        velocity = momentum * velocity + smooth_max_gradient(units, temperature)
        units = F.normalize(units - lr * velocity, dim=1, eps=NORM_FLOOR)
    return units.float()


def orthogonal_rows(num_classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Haar-random orthonormal rows, as ``torch.nn.init.orthogonal_`` draws them (a standard normal
    matrix, its QR with R's diagonal made positive), from ``generator``; then on the sphere (only
    a change where C > K, whose rows cannot all be orthonormal)."""
    matrix = torch.randn(num_classes, dim, generator=generator)
    tall = num_classes < dim
    q, r = torch.linalg.qr(matrix.t() if tall else matrix)
    q = q * torch.diagonal(r).sign()
    return F.normalize(q.t() if tall else q, dim=1, eps=NORM_FLOOR)


def initial_prototypes(options: FedNHOptions, num_classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """P^0 [C, K], unit rows, drawn from ``generator`` alone (so every world size agrees)."""
    if options.init == "orthogonal":
        return orthogonal_rows(num_classes, dim, generator)
    draw = torch.randn(num_classes, dim, generator=generator)
    return spread_on_sphere(draw, options.init_steps, options.init_lr, options.init_momentum,
                            options.init_temperature)


# ------------------------------------------------------------------------------ the client

class TrainedPrototypes(nn.Module):
    """The prototype table [C, K] a client last trained against, and whether it has trained yet
    (buffers: checkpointed with the client, no gradient)."""

    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("protos", torch.zeros(num_classes, dim))
        self.register_buffer("held", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def store(self, class_ids: torch.Tensor, prototypes: torch.Tensor) -> None:
        table = self.get_buffer("protos")
        table[class_ids.to(table.device)] = prototypes.to(table)
        self.get_buffer("held").fill_(True)


class Scale(nn.Module):
    """s_i, one learnable scalar of the cosine classifier."""

    def __init__(self, value: float, learnable: bool) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.tensor(float(value)), requires_grad=learnable)


def cosine_logits(features: torch.Tensor, prototypes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s·⟨f/‖f‖, P^c⟩ for every class, [B, C]; the prototypes arrive as unit rows."""
    return scale * (F.normalize(features, dim=1, eps=NORM_FLOOR) @ prototypes.t())


def fednh_fields(context: AlgorithmContext) -> PayloadSpec:
    """(class_ids, protos [m, K], counts int64 [m]): μ_i^c and n_i^c of the classes held."""
    return (*prototype_fields(context), Field("counts", torch.int64, max_rows=context.num_classes))


class FedNHClient(ClientAlgorithm):
    """CE on s_i·cosine to the downloaded prototypes; uploads the class means of f/‖f‖ and counts."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return fednh_fields(context)

    def init_client(self, client: ClientState) -> None:
        client.modules[SCALE_MODULE] = Scale(self.options.scale, self.options.learn_scale).to(client.device)
        if self.options.eval_prototypes == "trained":  # only then: runs under "updated" keep their modules
            table = TrainedPrototypes(self.context.num_classes, self.context.feature_dim)
            client.modules[TRAINED_MODULE] = table.to(client.device)

    def scale(self, client: ClientState) -> nn.Parameter:
        """s_i, the client's own (never uploaded)."""
        scale = client.modules[SCALE_MODULE]
        assert isinstance(scale, Scale)
        return scale.value

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        prototypes = knowledge["protos"].to(client.device)
        scale = self.scale(client)
        trained = client.modules.get(TRAINED_MODULE)
        if isinstance(trained, TrainedPrototypes):
            trained.store(knowledge["class_ids"], prototypes)

        def loss_fn(batch: Batch) -> torch.Tensor:
            return batch_cross_entropy(replace(batch, logits=cosine_logits(batch.features, prototypes, scale)))

        optimizers = [client.optimizer]
        if options.learn_scale:  # afresh each round, at the client's rate (the reference rebuilds its optimizer)
            optimizers.append(companion_optimizer(client, [scale], self.context.train))
        loss_sum, seen = run_local_training(
            client, self.context, loss_fn, generator,
            optimizers=optimizers if options.learn_scale else None,
            before_step=gradient_clipper([*client.model.parameters(), scale], options.clip_grad_norm))
        return TrainResult(self.make_upload(client), loss_sum, seen)

    def make_upload(self, client: ClientState) -> Payload:
        """μ_i^c (eval mode, every training sample), or μ_i^c/‖μ_i^c‖, and n_i^c."""
        num_classes = self.context.num_classes
        class_ids, means = class_means(client, num_classes, "features", unit_rows=True)
        if self.options.normalise_client_means:
            means = F.normalize(means, dim=1, eps=NORM_FLOOR)
        counts = torch.bincount(client.train_y.cpu(), minlength=num_classes)[class_ids]
        return {"class_ids": class_ids, "protos": means, "counts": counts}

    def theory_upload_floats(self, client: ClientState) -> int:
        """K·|C_i|: one K-row per class held (the counts are integers)."""
        return self.context.feature_dim * int(client.classes.numel())

    def scored_prototypes(self, client: ClientState, knowledge: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(class ids, unit rows) the client is scored with (``eval_prototypes``): the table it last
        trained against, or ``knowledge`` (the evaluation's download) under ``updated`` or before
        the client has trained."""
        trained = client.modules.get(TRAINED_MODULE)
        if isinstance(trained, TrainedPrototypes) and bool(trained.get_buffer("held")):
            table = trained.get_buffer("protos")
            return torch.arange(table.shape[0]), table
        return knowledge["class_ids"], knowledge["protos"]

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The class of the largest s_i·cosine: the client's classifier, with the prototypes
        ``eval_prototypes`` names."""
        class_ids, prototypes = self.scored_prototypes(client, knowledge)
        scores = cosine_logits(features, prototypes.to(features.device), self.scale(client).detach())
        return class_ids.to(features.device)[scores.argmax(dim=1)]


# ------------------------------------------------------------------------------ the server

def smooth_prototypes(prototypes: torch.Tensor, aggregate: torch.Tensor, present: torch.Tensor,
                      smoothing: float) -> torch.Tensor:
    """P^c ← (ρ·P^c + (1 − ρ)·a^c)/‖·‖ where ``present``; other rows unchanged."""
    mixed = F.normalize(smoothing * prototypes + (1 - smoothing) * aggregate, dim=1, eps=NORM_FLOOR)
    return torch.where(present.unsqueeze(1), mixed, prototypes)


class FedNHServer(ServerAlgorithm):
    """The C unit prototypes: spread at the start, then smoothed towards the count-weighted means."""

    accepts_late_uploads = True  # a late upload is one more weighted row in its classes' means

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return prototype_fields(context)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        generator = torch_generator(context.seed, "fednh-prototypes")
        self.prototypes = initial_prototypes(self.options, context.num_classes, context.feature_dim, generator)

    def download(self) -> Payload:
        return {"class_ids": torch.arange(self.context.num_classes), "protos": self.prototypes.clone()}

    def theory_download_floats(self) -> int:
        """K·C: every class's prototype."""
        return self.context.feature_dim * self.context.num_classes

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["protos"], self.context.num_classes)
        check_class_counts(client_id, upload["class_ids"], upload["counts"])

    def aggregate(self, uploads: dict[int, Payload]) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [C, K], present [C]): Σ_i n_i^c μ_i^c / Σ_i n_i^c, in float64 and client-id order (so
        the sums do not depend on the ranks), on the sphere with ``normalise_aggregate``."""
        means = ClassMeans(self.context.num_classes, self.context.feature_dim, dtype=torch.float64)
        for client_id in sorted(uploads):
            upload = uploads[client_id]
            means.add(upload["protos"], upload["class_ids"], upload["counts"])
        aggregate = means.dense().float()
        if self.options.normalise_aggregate:
            aggregate = F.normalize(aggregate, dim=1, eps=NORM_FLOOR)
        return aggregate, means.present()

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        previous = self.download()
        aggregate, present = self.aggregate(uploads)
        self.prototypes = smooth_prototypes(self.prototypes, aggregate, present, self.options.smoothing)
        metrics: dict[str, Any] = {"global_classes": float(present.sum())}
        if self.prototypes.shape[0] > 1:
            metrics["proto_max_cos"] = float(largest_cosines(self.prototypes).max())
        return {**metrics, **global_prototype_diagnostics(uploads, self.context.num_classes, self.download(),
                                                          previous)}

    def state_dict(self) -> dict[str, Any]:
        return {"protos": self.prototypes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prototypes = state["protos"]


register_algorithm("fednh", server=FedNHServer, client=FedNHClient, options=FedNHOptions,
                   summary="fixed unit class prototypes spread on the sphere, cosine classifier, prototypes "
                           "smoothed towards the clients' class means (Dai et al. 2023)",
                   conformance=ConformanceHints())
