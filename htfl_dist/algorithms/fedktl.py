"""FedKTL (Zhang et al., CVPR 2024): knowledge transfer from a server-side pre-trained generator
(docs/algorithms.md, "FedKTL").

Clients: g_i = h_i ∘ f_i maps into an ETF space R^K (K = C, h_i = the model's head), and a fixed
simplex-ETF classifier V, identical on every rank, sits on top. Local loss (Eq. 1, 4)

    L_i = ArcFace(ĝ_i(x), y; V, s, m) + μ · (1/|b|) Σ_{c∈b} MSE(h′_i(f_i(I^c)), Q^c)

over the downloaded pairs (I^c, Q^c) (none in round 1); h′_i = Linear(K′, H) restarts from one
shared initial state every round and is never uploaded. Upload: one prototype per class held, the
mean of g_i(x) (eval mode; paper), or the L2-normalised mean of L2-normalised g_i(x) (reference
code, ``unit_prototypes``). Inference: argmax_c cos(g_i(x), v_c).

Server: a feature transformer F = Linear(K, K) → BN → ReLU → Linear(K, H), persistent, trained
each round with a fresh Adam on the uploads for E_S epochs of mini-batches of B_S:

    L = MMD(F(P_b), W_b) + λ · L^MSE,    W_b = |b| fresh valid latents of the generator

(a sum of four Gaussian kernels, σ² ∈ {10, 15, 20, 50}, biased estimator). Then the latent
centroids Q^c = mean of F(P_i^c) (eval mode) over this round's uploads (a class nobody uploaded
keeps its last centroid, N(0, 1) at first), one image per class I^c = G(Q^c) resized to the
clients' images, and the C pairs go down.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import ClassMeans, check_class_rows, class_means, class_row_fields
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, run_local_training, train_on_pairs
from htfl_dist.errors import ConfigError
from htfl_dist.generators.base import LatentGenerator, to_client_images
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

KERNEL_SIGMA2 = (10.0, 15.0, 20.0, 50.0)
"""The reference code's four Gaussian bandwidths σ² (tuned for StyleGAN-XL's W, H = 512)."""
MEDIAN_ANCHOR = 20.0
"""bandwidth=median rescales the four σ² so that this one equals median(‖q − w‖²)/2."""
CLIP_NORM = 100.0
"""The reference code clips the gradients of the client model, h′_i, F and the centroid table to
norm 100 each. The paper names no clipping (nor any other numerical guard), so there is no paper
reading to default to: we keep the code's in both modes. It changes a step only when a gradient's
norm exceeds 100, and dropping it would change every FedKTL run for a choice the paper never makes."""
ARCCOS_EPS = 1e-7
"""cos θ_y is clamped into [−1 + ε, 1 − ε] before arccos, whose gradient is infinite at ±1."""
SATURATION_EPS = 1e-3

Bandwidth = Literal["fixed", "median"]
CentroidTarget = Literal["in_graph", "table"]


@dataclass
class FedKTLOptions:
    compat: Literal["paper", "htfllib"] = "paper"
    """htfllib: every knob left unset takes the reference code's value: the MSE target is the
    trainable centroid table, each local step uses a mini-batch of ``train.batch_size`` pairs, and
    the uploaded prototypes are unit vectors."""
    mu: float = 50.0
    """μ, the weight of the knowledge-transfer loss L^M on the client."""
    mse_weight: float = 1.0
    """λ, the weight of L^MSE on the server."""
    arcface_scale: float = 64.0
    """s of ArcFace (1 with margin 0 is the paper's plain cosine softmax, App. G)."""
    arcface_margin: float = 0.5
    """m of ArcFace."""
    server_lr: float = 0.01
    """η_S, Adam's learning rate for F (and the centroid table)."""
    server_epochs: int = 100
    """E_S, epochs over the round's prototypes."""
    server_batch_size: int = 100
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
    pairs_per_step: int | None = None
    """Downloaded pairs per local step: unset = all C (paper Eq. 4); htfllib = train.batch_size,
    shuffled and cycled."""
    unit_prototypes: bool | None = None
    """false: P_i^c = the mean of g_i(x) over the class's training samples (paper §3.3.2, "P_i^c =
    E g_i(x)"); true: the L2-normalised mean of the L2-normalised g_i(x), unit vectors in the
    ETF space whose cosines the classifier reads (htfllib)."""

    def validate(self) -> None:
        reference = self.compat == "htfllib"
        if self.unit_prototypes is None:
            self.unit_prototypes = reference
        if self.centroid_target is None:
            self.centroid_target = "table" if reference else "in_graph"
        for key in ("mu", "mse_weight", "arcface_margin"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config key 'algo.{key}' must be >= 0, got {getattr(self, key)}")
        for key in ("arcface_scale", "server_lr"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key 'algo.{key}' must be > 0, got {getattr(self, key)}")
        for key in ("server_epochs", "server_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key 'algo.{key}' must be >= 1, got {getattr(self, key)}")
        if self.pairs_per_step is not None and self.pairs_per_step < 1:
            raise ConfigError(f"config key 'algo.pairs_per_step' must be >= 1, got {self.pairs_per_step}")


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
        aux_optimizer = torch.optim.SGD(aux.parameters(), lr=train.lr)
        batches = PairBatches(images.shape[0], options.pairs_per_step or
                              (train.batch_size if options.compat == "htfllib" else None), generator)

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = arcface_loss(batch.logits, batch.labels, etf, options.arcface_scale, options.arcface_margin)
            if transfer:
                index = batches.next().to(client.device)
                predicted = aux(client.model.features(images[index]))  # train mode: BN sees them too
                loss = loss + options.mu * F.mse_loss(predicted, latents[index])
            return loss

        def clip() -> None:
            torch.nn.utils.clip_grad_norm_(client.model.parameters(), CLIP_NORM)
            torch.nn.utils.clip_grad_norm_(aux.parameters(), CLIP_NORM)

        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator,
                                            optimizers=(client.optimizer, aux_optimizer), before_step=clip)
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


# --------------------------------------------------------------------------- server maths


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_i − b_j‖², [n, m] (clamped at 0 against rounding)."""
    return (a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1).unsqueeze(0) - 2 * a @ b.t()).clamp(min=0)


def kernel_bandwidths(queries: torch.Tensor, latents: torch.Tensor, mode: Bandwidth) -> tuple[float, ...]:
    """The four σ²: the code's constants, or those rescaled to the batch's median distance."""
    if mode == "fixed":
        return KERNEL_SIGMA2
    median = float(squared_distances(queries.detach(), latents).median())
    scale = max(median, 1e-12) / 2 / MEDIAN_ANCHOR
    return tuple(sigma2 * scale for sigma2 in KERNEL_SIGMA2)


def gaussian_kernels(distances: torch.Tensor, bandwidths: tuple[float, ...]) -> torch.Tensor:
    """Σ_k exp(−d² / (2σ_k²)) elementwise."""
    return sum(torch.exp(-distances / (2 * sigma2)) for sigma2 in bandwidths)


def mmd_loss(queries: torch.Tensor, latents: torch.Tensor, bandwidths: tuple[float, ...]) -> torch.Tensor:
    """Eq. 3 as the reference code computes it: the biased (V-statistic) squared MMD with the sum
    of Gaussian kernels, mean(K_qq) + mean(K_ww) − 2·mean(K_qw), diagonals included."""
    return (gaussian_kernels(squared_distances(queries, queries), bandwidths).mean()
            + gaussian_kernels(squared_distances(latents, latents), bandwidths).mean()
            - 2 * gaussian_kernels(squared_distances(queries, latents), bandwidths).mean())


def kernel_saturation(queries: torch.Tensor, latents: torch.Tensor, bandwidths: tuple[float, ...]) -> float:
    """Share of the cross-kernel entries exp(−‖q − w‖²/2σ²), over the four σ², that are below
    1e-3 or above 1 − 1e-3: near 1, the MMD gradient carries almost no signal."""
    distances = squared_distances(queries, latents)
    saturated = [((k < SATURATION_EPS) | (k > 1 - SATURATION_EPS)).float().mean()
                 for k in (torch.exp(-distances / (2 * s)) for s in bandwidths)]
    return float(torch.stack(saturated).mean())


def in_graph_mse(queries: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Eq. 2 on a batch: (1/|classes|) Σ_c (1/|M_c|) Σ_{i∈M_c} MSE(F(P_i^c), Q̄^c), with Q̄^c the
    in-graph mean of the batch's F(P_i^c) (MSE = mean over the H elements)."""
    onehot = F.one_hot(labels, num_classes).to(queries.dtype)
    counts = onehot.sum(0)
    means = (onehot.t() @ queries) / counts.clamp(min=1).unsqueeze(1)
    per_pair = (queries - means[labels]).pow(2).mean(dim=1)
    per_class = (onehot.t() @ per_pair) / counts.clamp(min=1)
    return per_class.sum() / (counts > 0).sum()


class FeatureTransformer(nn.Module):
    """F: Linear(K, K) → BatchNorm1d(K) → ReLU → Linear(K, H), prototype → generator latent.

    The paper lists "two FC layers and one BN layer" (Fig. 3b) and names no activation; the
    reference code has this ReLU, and without one F would be affine in eval mode (BN then is a
    fixed scale and shift), so the two layers would collapse into one. We keep the ReLU."""

    def __init__(self, dim: int, latent_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(), nn.Linear(dim, latent_dim))

    def forward(self, protos: torch.Tensor) -> torch.Tensor:
        return self.layers(protos)


class FedKTLServer(ServerAlgorithm):
    """Trains F, keeps the C latent centroids, and turns them into the round's C image–latent pairs."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        """C images at the clients' shape and their C latents, row c for class ``class_ids[c]`` (no
        rows before the first update)."""
        return (Field("class_ids", torch.int64),
                Field("images", torch.float32, (context.in_channels, context.image_size, context.image_size)),
                Field("latents", torch.float32, (context.latent_dim,)))

    def __init__(self, context: AlgorithmContext, generator: LatentGenerator) -> None:
        super().__init__(context)
        num_classes, latent_dim = context.num_classes, context.latent_dim
        if generator.latent_dim != latent_dim:
            raise ConfigError(f"generator latents are {generator.latent_dim} wide, the context says {latent_dim}")
        self.device = context.device
        self.generator = generator.to(self.device)
        self.transformer = FeatureTransformer(num_classes, latent_dim).to(self.device)
        self.centroids = torch.randn(num_classes, latent_dim).to(self.device)  # [C] never uploaded: N(0, 1)
        self.images = torch.empty(0, context.in_channels, context.image_size, context.image_size)
        self.latents = torch.empty(0, latent_dim)

    def theory_download_floats(self) -> int:
        """C·(c·R² + H): C images at client resolution and C latents (paper Table 5)."""
        context = self.context
        return context.num_classes * (context.in_channels * context.image_size ** 2 + context.latent_dim)

    def download(self) -> Payload:
        class_ids = torch.arange(self.latents.shape[0])  # all C once trained, none before
        return {"class_ids": class_ids, "images": self.images, "latents": self.latents}

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["protos"], self.context.num_classes)

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        if not uploads:  # every upload screened out: the last pairs stay
            return {}
        protos = torch.cat([uploads[cid]["protos"] for cid in sorted(uploads)]).to(self.device)
        labels = torch.cat([uploads[cid]["class_ids"] for cid in sorted(uploads)]).to(self.device)
        if protos.shape[0] == 0:
            return {}
        table = self._round_table(protos, labels)
        server_loss = self._train(protos, labels, table, generator) if protos.shape[0] > 1 else None
        present = self._store_centroids(protos, labels)
        self._synthesize()
        return {"server_loss": server_loss, "server_pairs": int(protos.shape[0]),
                "stale_classes": int((~present).sum()), **self._diagnostics(protos, labels, generator)}

    @torch.no_grad()
    def _eval_means(self, protos: torch.Tensor, labels: torch.Tensor) -> ClassMeans:
        self.transformer.eval()
        means = ClassMeans(self.context.num_classes, self.context.latent_dim, self.device)
        means.add(self.transformer(protos), labels)
        return means

    def _round_table(self, protos: torch.Tensor, labels: torch.Tensor) -> nn.Parameter | None:
        """table target: the centroid rows of this round's classes reset to the eval-mode means."""
        if self.options.centroid_target != "table":
            return None
        means = self._eval_means(protos, labels)
        present = means.present()
        return nn.Parameter(torch.where(present.unsqueeze(1), means.dense(), self.centroids))

    def _train(self, protos: torch.Tensor, labels: torch.Tensor, table: nn.Parameter | None,
               generator: torch.Generator) -> float:
        options = self.options
        modules = [list(self.transformer.parameters())] + ([[table]] if table is not None else [])
        optimizer = torch.optim.Adam([p for group in modules for p in group], lr=options.server_lr)

        def loss_fn(rows: torch.Tensor, batch_labels: torch.Tensor) -> torch.Tensor:
            queries = self.transformer(rows)
            loss = queries.new_zeros(())
            if options.use_mmd:
                latents = self.generator.sample_latents(rows.shape[0], generator).to(queries)
                loss = loss + mmd_loss(queries, latents, kernel_bandwidths(queries, latents, options.mmd_bandwidth))
            if options.use_mse:
                loss = loss + options.mse_weight * (
                    F.mse_loss(queries, table[batch_labels]) if table is not None
                    else in_graph_mse(queries, batch_labels, self.context.num_classes))
            return loss

        def clip() -> None:
            for group in modules:
                torch.nn.utils.clip_grad_norm_(group, CLIP_NORM)

        self.transformer.train()
        return train_on_pairs(protos, labels, loss_fn, optimizer, epochs=options.server_epochs,
                              batch_size=options.server_batch_size, generator=generator,
                              before_step=clip, skip_single=True)

    def _store_centroids(self, protos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Q^c = mean of F(P_i^c) (eval mode) over this round's uploads; others keep theirs."""
        means = self._eval_means(protos, labels)
        present = means.present()
        self.centroids = torch.where(present.unsqueeze(1), means.dense(), self.centroids)
        return present

    @torch.no_grad()
    def _synthesize(self) -> None:
        """I^c = G(Q^c) for every class, at the clients' resolution, channels and normalisation."""
        context = self.context
        images = self.generator.synthesize(self.centroids)
        self.images = to_client_images(images, context.image_size, context.in_channels).float().cpu()
        self.latents = self.centroids.float().cpu()

    @torch.no_grad()
    def _diagnostics(self, protos: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """On all the round's prototypes after training (F in eval mode): the MMD to as many fresh
        latents, how saturated its kernels are, L^MSE, and how far apart the C centroids are."""
        self.transformer.eval()
        queries = self.transformer(protos)
        latents = self.generator.sample_latents(protos.shape[0], generator).to(queries)
        bandwidths = kernel_bandwidths(queries, latents, self.options.mmd_bandwidth)
        gaps = squared_distances(self.centroids, self.centroids).sqrt()
        gaps.fill_diagonal_(float("inf"))
        return {
            "mmd": float(mmd_loss(queries, latents, bandwidths)),
            "mmd_kernel_saturation": kernel_saturation(queries, latents, bandwidths),
            "mse": float(in_graph_mse(queries, labels, self.context.num_classes)),
            "centroid_min_dist": float(gaps.min()),
            "centroid_norm_mean": float(self.centroids.norm(dim=1).mean()),
            "latent_norm_mean": float(latents.norm(dim=1).mean()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"transformer": self.transformer.state_dict(), "centroids": self.centroids.cpu(),
                "images": self.images, "latents": self.latents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.transformer.load_state_dict(state["transformer"])
        self.centroids = state["centroids"].to(self.device)
        self.images, self.latents = state["images"], state["latents"]


register_algorithm("fedktl", server=FedKTLServer, client=FedKTLClient, options=FedKTLOptions,
                   summary="ETF + ArcFace clients, server-side pre-trained generator turns prototypes into "
                           "image-latent pairs (Zhang et al. 2024)", uses_generator=True)
