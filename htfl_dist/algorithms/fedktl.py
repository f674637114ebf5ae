"""FedKTL (Zhang et al., CVPR 2024): knowledge transfer from a server-side pre-trained generator
(docs/algorithms.md, "FedKTL").

Clients: g_i = h_i ∘ f_i maps into an ETF space R^K (K = C, h_i = the model's head), and a fixed
simplex-ETF classifier V, identical on every rank, sits on top. Local loss (Eq. 1, 4)

    L_i = ArcFace(ĝ_i(x), y; V, s, m) + μ · (1/|b|) Σ_{c∈b} MSE(h′_i(f_i(I^c)), Q^c)

over the downloaded pairs (I^c, Q^c) (none in round 1); h′_i = Linear(K′, H) restarts from one
shared initial state every round and is never uploaded. Upload: one prototype per class held, the
mean of g_i(x) (eval mode; paper), or the L2-normalised mean of L2-normalised g_i(x) (reference
code, ``unit_prototypes``). Inference: argmax_c cos(g_i(x), v_c).

Server (``fedktl_server``): a feature transformer maps the uploaded prototypes into the latent
space of a pre-trained generator; the latent centroid of each class becomes one image per class,
and the C image–latent pairs go down.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import class_means, class_row_fields
from htfl_dist.algorithms.fedktl_server import CLIP_NORM, Bandwidth, CentroidTarget, FedKTLServer
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, TrainResult
from htfl_dist.algorithms.optimizers import companion_optimizer
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

ARCCOS_EPS = 1e-7
"""cos θ_y is clamped into [−1 + ε, 1 − ε] before arccos, whose gradient is infinite at ±1."""



@dataclass
class FedKTLOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes the reference code's value: the MSE target is the
    trainable centroid table, each local step uses a mini-batch of ``train.batch_size`` pairs, and
    the uploaded prototypes are unit vectors."""
    mu: float = bounded(50.0, at_least=0)
    """μ, the weight of the knowledge-transfer loss L^M on the client."""
    mse_weight: float = bounded(1.0, at_least=0)
    """λ, the weight of L^MSE on the server."""
    arcface_scale: float = bounded(64.0, above=0)
    """s of ArcFace (1 with margin 0 is the paper's plain cosine softmax, App. G)."""
    arcface_margin: float = bounded(0.5, at_least=0)
    """m of ArcFace."""
    server_lr: float = bounded(0.01, above=0)
    """η_S, Adam's learning rate for F (and the centroid table)."""
    server_epochs: int = bounded(100, at_least=1)
    """E_S, epochs over the round's prototypes."""
    server_batch_size: int = bounded(100, at_least=1)
    """B_S, prototypes per server step."""
    mmd_bandwidth: Bandwidth = "fixed"
    """fixed: σ² ∈ {10, 15, 20, 50} (paper code); median: the same four scaled so that 20 becomes
    median(‖F(P) − w‖²)/2 per batch (for generators whose latents are on another scale)."""
    use_mmd: bool = True
    """False drops L^MMD (paper Table 7, "−L^MMD")."""
    use_mse: bool = True
    """False drops L^MSE (paper Table 7, "−L^MSE")."""
    centroid_target: CentroidTarget | None = None
    """in_graph: L^MSE pulls F(P_i^c) to the class mean of the batch, class-balanced (paper Eq. 2);
    table: to a trainable centroid table reset to the eval-mode means each round, each pair
    weighted equally (htfllib)."""
    pairs_per_step: int | None = bounded(None, at_least=1, optional=True)
    """Downloaded pairs per local step: unset = all C (paper Eq. 4); htfllib = train.batch_size,
    shuffled and cycled."""
    unit_prototypes: bool | None = None
    """false: P_i^c = the mean of g_i(x) over the class's training samples (paper §3.3.2, "P_i^c =
    E g_i(x)"); true: the L2-normalised mean of the L2-normalised g_i(x), unit vectors in the
    ETF space whose cosines the classifier reads (htfllib)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.unit_prototypes is None:
            self.unit_prototypes = reference
        if self.centroid_target is None:
            self.centroid_target = "table" if reference else "in_graph"


# --------------------------------------------------------------------------- client maths


def simplex_etf(num_classes: int, dim: int, seed: int) -> torch.Tensor:
    """V = sqrt(C/(C−1)) · U · (I − 11ᵀ/C), U ∈ R^{K×C} with orthonormal columns (the Q of a QR
    of a uniform [0, 1) matrix drawn from stream (seed, "fedktl-etf")). Unit columns, pairwise
    cosines −1/(C−1). Computed on the CPU in float64, so every rank holds the identical V."""
    if dim < num_classes:
        raise ConfigError(f"FedKTL's ETF needs K >= C (K = {dim}, C = {num_classes})")
    if num_classes < 2:
        raise ConfigError("FedKTL's ETF classifier needs at least 2 classes")
    draw = torch.rand(dim, num_classes, generator=torch_generator(seed, "fedktl-etf"), dtype=torch.float64)
    basis, _ = torch.linalg.qr(draw)
    centring = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
    etf = math.sqrt(num_classes / (num_classes - 1)) * basis @ centring
    return F.normalize(etf, dim=0).float()  # columns are unit already; this removes rounding


def etf_cosines(outputs: torch.Tensor, etf: torch.Tensor) -> torch.Tensor:
    """cos(g_i(x), v_c) for every class, [n, C]."""
    return F.normalize(outputs, dim=1) @ etf


def arcface_loss(outputs: torch.Tensor, labels: torch.Tensor, etf: torch.Tensor, scale: float,
                 margin: float) -> torch.Tensor:
    """Eq. 1: CE over s·cos θ_c, with the target's logit s·cos(θ_y + m)."""
    cosines = etf_cosines(outputs, etf)
    target = cosines.gather(1, labels.unsqueeze(1)).clamp(-1 + ARCCOS_EPS, 1 - ARCCOS_EPS)
    logits = cosines.scatter(1, labels.unsqueeze(1), torch.cos(torch.acos(target) + margin))
    return F.cross_entropy(scale * logits, labels)


def auxiliary_projection(feature_dim: int, latent_dim: int, seed: int) -> nn.Linear:
    """h′ = Linear(K′, H) with PyTorch's default distribution (U(±1/√K′) for weight and bias), drawn
    from stream (seed, "fedktl-aux"): every client on every rank restarts from this same state."""
    stream = torch_generator(seed, "fedktl-aux")
    layer = nn.Linear(feature_dim, latent_dim, device="meta").to_empty(device="cpu")  # no global RNG draw
    bound = 1.0 / math.sqrt(feature_dim)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=stream) * 2 * bound - bound)
        layer.bias.copy_(torch.rand(layer.bias.shape, generator=stream) * 2 * bound - bound)
    return layer


class PairBatches:
    """Indices of the downloaded pairs for each local step: all C (paper), or shuffled mini-batches
    of ``size`` cycled through (reference code), reshuffled with ``generator`` at every pass. A
    pass's last lone pair is dropped: the generated images go through f_i in train mode, and
    BatchNorm on 1×1 maps cannot train on one sample."""

    def __init__(self, count: int, size: int | None, generator: torch.Generator) -> None:
        self.count, self.size, self.generator = count, size, generator
        self.order = torch.empty(0, dtype=torch.int64)

    def next(self) -> torch.Tensor:
        if self.size is None:
            return torch.arange(self.count)
        if self.order.numel() < min(2, self.count):
            self.order = torch.randperm(self.count, generator=self.generator)
        batch, self.order = self.order[: self.size], self.order[self.size :]
        return batch


class FedKTLClient(ClientAlgorithm):
    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields("protos", context.num_classes, context.num_classes)

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        if context.latent_dim < 1:
            raise ConfigError("FedKTL needs a generator (generator.name)")

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.etf = simplex_etf(context.num_classes, context.num_classes, context.seed)
        self.aux_init = auxiliary_projection(context.feature_dim, context.latent_dim, context.seed)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options, train = self.options, self.context.train
        etf = self.etf.to(client.device)
        images, latents = knowledge["images"].to(client.device), knowledge["latents"].to(client.device)
        transfer = images.shape[0] > 0 and options.mu > 0  # round 1: ArcFace only
        aux = copy.deepcopy(self.aux_init).to(client.device)  # the shared initial state, every round
        aux_optimizer = companion_optimizer(client, aux.parameters(), train)
        batches = PairBatches(images.shape[0], options.pairs_per_step or
                              (train.batch_size if options.compat == "reference" else None), generator)

        def arcface(batch: Batch) -> torch.Tensor:
            return arcface_loss(batch.logits, batch.labels, etf, options.arcface_scale, options.arcface_margin)

        def transfer_loss() -> torch.Tensor:
            """μ·L^M on the step's downloaded pairs: no training sample enters it."""
            index = batches.next().to(client.device)
            predicted = aux(client.model.features(images[index]))  # train mode: BN sees them too
            return options.mu * F.mse_loss(predicted, latents[index])

        def clip() -> None:
            torch.nn.utils.clip_grad_norm_(client.model.parameters(), CLIP_NORM)
            torch.nn.utils.clip_grad_norm_(aux.parameters(), CLIP_NORM)

        if client.private is None:
            loss_fn = (lambda batch: arcface(batch) + transfer_loss()) if transfer else arcface
            loss_sum, seen = run_local_training(client, self.context, loss_fn, generator,
                                                optimizers=(client.optimizer, aux_optimizer), before_step=clip)
        else:  # DP-SGD on ArcFace; L^M reads only downloads, so it is added after the noise
            loss_sum, seen = client.private.train(client, self.context, arcface, generator,
                                                  public_loss=transfer_loss if transfer else None,
                                                  public_optimizers=(aux_optimizer,), before_step=clip)
        class_ids, protos = self.prototypes(client)
        return TrainResult({"class_ids": class_ids, "protos": protos}, loss_sum, seen)

    def prototypes(self, client: ClientState) -> tuple[torch.Tensor, torch.Tensor]:
        """P_i^c per class held, eval mode, training split: the mean of g_i(x), or with
        ``unit_prototypes`` the mean of ĝ_i(x) normalised again."""
        unit = self.options.unit_prototypes
        class_ids, protos = class_means(client, self.context.num_classes, "logits", unit_rows=unit)
        return class_ids, F.normalize(protos, dim=1) if unit else protos

    def theory_upload_floats(self, client: ClientState) -> int:
        """K·|C_i| with K = C (paper Table 5)."""
        return self.context.num_classes * int(client.classes.numel())

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The nearest ETF column by cosine: V is part of every client's classifier."""
        return etf_cosines(logits, self.etf.to(logits.device)).argmax(dim=1)

    def head_predict(self, client: ClientState, logits: torch.Tensor) -> torch.Tensor:
        """The same rule: h_i's raw outputs live in the ETF space and mean nothing without V."""
        return self.predict(client, {}, logits, logits)


register_algorithm("fedktl", server=FedKTLServer, client=FedKTLClient, options=FedKTLOptions,
                   summary="ETF + ArcFace clients, server-side pre-trained generator turns prototypes into "
                           "image-latent pairs (Zhang et al. 2024)", uses_generator=True, private_release=True,
                   conformance=ConformanceHints(ranks_checked_in="tests/algorithms/test_fedktl.py, on 3 torchrun ranks "
                                                                 "and mpirun -n 3 stopped after round 1 and resumed"))
