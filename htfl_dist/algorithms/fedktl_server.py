"""FedKTL's server (Zhang et al., CVPR 2024; docs/algorithms.md, "FedKTL"): a feature transformer
F = Linear(K, K) → BN → ReLU → Linear(K, H), persistent, trained each round with a fresh Adam on
the uploaded prototypes for E_S epochs of mini-batches of B_S:

    L = MMD(F(P_b), W_b) + λ · L^MSE,    W_b = |b| fresh valid latents of the generator

(a sum of four Gaussian kernels, σ² ∈ {10, 15, 20, 50}, biased estimator). Then the latent
centroids Q^c = mean of F(P_i^c) (eval mode) over this round's uploads (a class nobody uploaded
keeps its last centroid, N(0, 1) at first), one image per class I^c = G(Q^c) resized to the
clients' images, and the C pairs go down. The client side and the options are in ``fedktl``.
"""
from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import ClassMeans, check_class_rows
from htfl_dist.algorithms.interface import AlgorithmContext, ServerAlgorithm
from htfl_dist.algorithms.training import train_on_pairs
from htfl_dist.errors import ConfigError
from htfl_dist.generators.base import LatentGenerator, to_client_images
from htfl_dist.payload import Field, Payload, PayloadSpec

KERNEL_SIGMA2 = (10.0, 15.0, 20.0, 50.0)
"""The reference code's four Gaussian bandwidths σ² (tuned for StyleGAN-XL's W, H = 512)."""
MEDIAN_ANCHOR = 20.0
"""bandwidth=median rescales the four σ² so that this one equals median(‖q − w‖²)/2."""
CLIP_NORM = 100.0
"""The reference code clips the gradients of the client model, h′_i, F and the centroid table to
norm 100 each. The paper names no clipping (nor any other numerical guard), so there is no paper
reading to default to: we keep the code's in both modes. It changes a step only when a gradient's
norm exceeds 100, and dropping it would change every FedKTL run for a choice the paper never makes."""
SATURATION_EPS = 1e-3

Bandwidth = Literal["fixed", "median"]
CentroidTarget = Literal["in_graph", "table"]


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
    # (sum() of tensors is typed "Tensor | Literal[0]"; there are always four bandwidths)
    return cast(torch.Tensor, sum(torch.exp(-distances / (2 * sigma2)) for sigma2 in bandwidths))


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
