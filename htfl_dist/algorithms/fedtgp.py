"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with adaptive-margin-enhanced
contrastive learning (docs/algorithms.md, "FedTGP").

Clients are FedProto's (upload P_i^c for the classes they hold, regularise towards P̂, classify
by the nearest global prototype). The server keeps one trainable vector per class and a shared
two-layer network F; P̂^c = F(vector_c). Each round it trains them for S epochs on the uploaded
(P_i^c, c) pairs with the margin contrastive loss

    d_k = ‖p − P̂^k‖₂,   d_c += δ(t),   loss = CE(−d, c)                      (Eq. 10)

where δ(t) = min(max_c gap_c, τ) and gap_c is the distance from class c's cluster centre (the
mean of the uploaded P_i^c) to the nearest other centre (Eq. 9, as the reference code reads it).
All C global prototypes are downloaded; no class counts travel. The server machinery (the
prototype generator, the pair-training loop, download and state) is ``TrainablePrototypeServer``,
which FedOC shares with its own loss.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    check_class_rows,
    euclidean_distances,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.fedproto import PrototypeClient, PrototypeOptions, prototype_fields
from htfl_dist.algorithms.interface import AlgorithmContext, ServerAlgorithm
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import train_on_pairs
from htfl_dist.config import bounded
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Payload, PayloadSpec

Margin = Literal["adaptive", "fixed", "none"]
GAP_UNSET = float("inf")


@dataclass
class FedTGPOptions(PrototypeOptions):
    margin: Margin = "adaptive"
    """adaptive: δ(t) = min(max_c gap_c, τ) (FedTGP); fixed: δ = fixed_margin (Table 6 "FM");
    none: δ = 0, the standard contrastive loss (Table 6 "SCL")."""
    tau: float = bounded(100.0, at_least=0)
    """Margin threshold τ."""
    fixed_margin: float | None = None
    """δ for margin=fixed (the paper gives no value, so it must be set)."""
    use_mapping: bool = True
    """False trains the per-class vectors only, without F (Table 6 "w/o F")."""
    hidden_dim: int | None = bounded(None, at_least=1, optional=True)
    """Width of F's hidden layer (default K)."""
    server_epochs: int = bounded(100, at_least=1)
    """S: epochs over the round's pairs."""
    server_lr: float = bounded(0.01, above=0)
    server_batch_size: int | None = bounded(None, at_least=1, optional=True)
    """Mini-batch of pairs (default: the client batch size, as the reference code does)."""

    def validate(self) -> None:
        super().validate()
        if self.margin == "fixed" and (self.fixed_margin is None or self.fixed_margin < 0):
            raise ConfigError("algo.margin=fixed needs algo.fixed_margin=VALUE (>= 0); the paper gives no default")


class TrainableGlobalPrototypes(nn.Module):
    """P̂^c = F(vector_c) with F = Linear(K, H) → ReLU → Linear(H, K), or the vectors alone."""

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int, use_mapping: bool) -> None:
        super().__init__()
        self.vectors = nn.Embedding(num_classes, feature_dim)
        self.mapping = (
            nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, feature_dim))
            if use_mapping else nn.Identity()
        )

    def forward(self) -> torch.Tensor:
        """All C global prototypes, [C, K]."""
        return self.mapping(self.vectors.weight)


def initial_prototypes(context: AlgorithmContext, hidden_dim: int, use_mapping: bool) -> TrainableGlobalPrototypes:
    """P̃ and F as they start. From torch's global RNG, which the runtime seeds (seed,
    "server-init") before it builds the server; under ``model.init=htfllib``, as the reference
    codes draw them, so a side-by-side starts from the same prototypes: HtFLlib's ``clientTGP``
    and FedORGP's ``clientOrtho`` (both versions) call ``torch.manual_seed(0)`` after building
    their model, and the server's ``Trainable_Global_Prototypes`` / ``Trainable_prototypes``,
    made right after the last client, draws ``nn.Embedding(C, K)``, ``nn.Linear(K, H)``,
    ``nn.Linear(H, K)`` in that order from that freshly seeded generator (here seeded with the
    run seed, as that init's client models are). The caller's RNG is left as it was."""
    def build() -> TrainableGlobalPrototypes:
        return TrainableGlobalPrototypes(context.num_classes, context.feature_dim, hidden_dim, use_mapping)

    if context.model_init != "htfllib":
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(context.seed)
        return build()


def cluster_gaps(centres: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """gap_c = min_{c'≠c, both present} ‖Q^c − Q^{c'}‖₂ for present classes; absent classes
    get the smallest gap (the reference code's rule), so they never raise max_c gap_c. With
    fewer than two present classes every gap is +inf, so δ(t) = τ, as in the reference code
    (which starts gaps at 1e9). Returns [C]."""
    distances = euclidean_distances(centres, centres)
    valid = present.unsqueeze(0) & present.unsqueeze(1)
    valid.fill_diagonal_(False)
    gaps = torch.where(valid, distances, torch.full_like(distances, GAP_UNSET)).min(dim=1).values
    finite = torch.isfinite(gaps)
    fill = gaps[finite].min() if bool(finite.any()) else torch.tensor(GAP_UNSET, dtype=gaps.dtype)
    return torch.where(finite, gaps, fill)


def adaptive_margin(centres: torch.Tensor, present: torch.Tensor, tau: float) -> float:
    """δ(t) = min(max_c gap_c, τ)."""
    return float(min(float(cluster_gaps(centres, present).max()), tau))


def margin_offsets(labels: torch.Tensor, num_classes: int, margin: float) -> torch.Tensor:
    """δ·[k = c] for each pair, [N, C]: the margin added to the distance to the pair's own class."""
    return margin * F.one_hot(labels, num_classes).float()


def margin_contrastive_loss(pairs: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor,
                            margin: float | torch.Tensor) -> torch.Tensor:
    """Eq. 10: CE over −(‖p − P̂^k‖ + δ·[k = c]); Euclidean, not squared.

    ``margin`` is δ, or the pairs' precomputed :func:`margin_offsets` (the server loop builds
    them once per round instead of once per step)."""
    if not isinstance(margin, torch.Tensor):
        margin = margin_offsets(labels, global_protos.shape[0], margin)
    distances = euclidean_distances(pairs, global_protos) + margin
    return F.cross_entropy(-distances, labels)


def class_margins(protos: torch.Tensor) -> torch.Tensor:
    """Per row: distance to the nearest other row (the 'prototype margin' of FedTGP Fig. 1)."""
    if protos.shape[0] < 2:
        return torch.full((protos.shape[0],), float("nan"))
    distances = euclidean_distances(protos, protos)
    distances.fill_diagonal_(float("inf"))
    return distances.min(dim=1).values


class TrainablePrototypeServer(ServerAlgorithm):
    """The server of the trainable-prototype methods (FedTGP, FedOC): P̂^c = F(vector_c) for all C
    classes (:class:`TrainableGlobalPrototypes`), trained each round on the uploaded (P_i^c, c)
    pairs, in client-id order, with plain SGD created afresh. Nothing goes down before the first
    update (round-0 clients train with CE only); after it, every class's prototype does.

    A variant supplies ``fit`` (its loss, through :meth:`train_prototypes`) and ``diagnostics``.
    Options read: ``hidden_dim``, ``server_lr``, ``server_epochs``, ``server_batch_size``."""

    accepts_late_uploads = True  # a late upload is one more prototype to train on

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return prototype_fields(context)

    def theory_download_floats(self) -> int:
        """K·C: every class's global prototype."""
        return self.context.feature_dim * self.context.num_classes

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        options, dim = self.options, context.feature_dim
        self.device = context.device
        self.tgp = initial_prototypes(context, options.hidden_dim or dim, self.use_mapping()).to(self.device)
        self.trained = False  # round 0 clients get no global knowledge (CE only)
        self._cached_protos: torch.Tensor | None = None

    @torch.no_grad()
    def global_prototypes(self) -> torch.Tensor:
        """P̂ for all classes, computed once per update (download and diagnostics share it)."""
        if self._cached_protos is None:
            self.tgp.eval()
            # a copy: without F the output is the trainable parameter itself, which SGD moves in place
            self._cached_protos = self.tgp().float().clone()
        return self._cached_protos

    def download(self) -> Payload:
        num_classes, dim = self.context.num_classes, self.context.feature_dim
        if not self.trained:
            return {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, dim)}
        return {"class_ids": torch.arange(num_classes), "protos": self.global_prototypes().cpu()}

    def _pairs(self, uploads: dict[int, Payload]) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's (P_i^c, c) pairs in client-id order (so the shuffle is world-size free)."""
        protos, labels = [], []
        for client_id in sorted(uploads):
            payload = uploads[client_id]
            protos.append(payload["protos"])
            labels.append(payload["class_ids"])
        return torch.cat(protos).to(self.device), torch.cat(labels).to(self.device)

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["protos"], self.context.num_classes)

    def use_mapping(self) -> bool:
        """Whether P̂ = F(P̃) (True) or P̃ itself; only FedTGP's "w/o F" ablation says False."""
        return True

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict:
        pairs, labels = self._pairs(uploads)
        if pairs.shape[0] == 0:
            return {}
        previous = self.download()
        trained = self.fit(pairs, labels, generator)
        self.trained = True
        return {**trained, **self.diagnostics(uploads, pairs, labels, previous)}

    def fit(self, pairs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> dict:
        """Train the prototypes on the round's pairs; return numbers for the metrics row."""
        raise NotImplementedError

    def diagnostics(self, uploads: dict[int, Payload], pairs: torch.Tensor, labels: torch.Tensor,
                    previous: Payload) -> dict:
        """Extra numbers for the metrics row, after training (``previous``: the download before it)."""
        return {}

    def train_prototypes(self, pairs: torch.Tensor, labels: torch.Tensor,
                         loss_fn: Callable[..., torch.Tensor], generator: torch.Generator,
                         per_pair: Sequence[torch.Tensor] = ()) -> float:
        """``server_epochs`` of shuffled mini-batch SGD (a new optimizer each round) on
        ``loss_fn(batch_pairs, batch_labels, P̂, *batch_per_pair)``, with all C prototypes
        regenerated at every step; returns the last epoch's mean loss."""
        options = self.options
        optimizer = torch.optim.SGD(self.tgp.parameters(), lr=options.server_lr)  # re-created each round
        self._cached_protos = None
        self.tgp.train()
        return train_on_pairs(
            pairs, labels, lambda rows, batch_labels, *extra: loss_fn(rows, batch_labels, self.tgp(), *extra),
            optimizer, epochs=options.server_epochs,
            batch_size=options.server_batch_size or self.context.train.batch_size,
            generator=generator, per_pair=per_pair)

    def state_dict(self) -> dict:
        return {"tgp": self.tgp.state_dict(), "trained": torch.tensor(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.tgp.load_state_dict(state["tgp"])
        self._cached_protos = None
        self.trained = bool(state["trained"])


class FedTGPServer(TrainablePrototypeServer):
    def use_mapping(self) -> bool:
        return self.options.use_mapping

    def _margin(self, pairs: torch.Tensor, labels: torch.Tensor) -> float:
        options = self.options
        if options.margin == "none":
            return 0.0
        if options.margin == "fixed":
            return float(options.fixed_margin)
        centres = ClassMeans(self.context.num_classes, pairs.shape[1], pairs.device)
        centres.add(pairs, labels)
        return adaptive_margin(centres.dense(), centres.present(), options.tau)

    def fit(self, pairs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> dict:
        margin = self._margin(pairs, labels)
        server_loss = self._train(pairs, labels, margin, generator)
        return {"margin": margin, "server_loss": server_loss, "server_pairs": int(pairs.shape[0])}

    def _train(self, pairs: torch.Tensor, labels: torch.Tensor, margin: float, generator: torch.Generator) -> float:
        """S epochs of shuffled mini-batch SGD on the pairs; returns the last epoch's mean loss.
        The margin offsets are built once per round and shuffled with the pairs."""
        offsets = margin_offsets(labels, self.context.num_classes, margin)
        return self.train_prototypes(pairs, labels, margin_contrastive_loss, generator, per_pair=(offsets,))

    def diagnostics(self, uploads: dict[int, Payload], pairs: torch.Tensor, labels: torch.Tensor,
                    previous: Payload) -> dict:
        return {**self._diagnostics(uploads),
                **global_prototype_diagnostics(uploads, self.context.num_classes, self.download(), previous)}

    @torch.no_grad()
    def _diagnostics(self, uploads: dict[int, Payload]) -> dict:
        """Separation of the global prototypes and FedTGP Fig. 1: per class, the global prototype
        margin vs the largest margin any client's own prototypes have."""
        global_margin = class_margins(self.global_prototypes().cpu())
        class_ids = torch.cat([p["class_ids"] for p in uploads.values()])
        margins = torch.cat([class_margins(p["protos"].float()) for p in uploads.values()])
        known = ~torch.isnan(margins)  # a client holding one class has no margin
        client_best = torch.full((self.context.num_classes,), float("nan"))
        client_best.scatter_reduce_(0, class_ids[known], margins[known], "amax", include_self=False)
        as_list = lambda t: [None if v != v else round(v, 6) for v in t.tolist()]  # noqa: E731
        return {
            "proto_min_dist": float(global_margin.min()),
            "class_margin_global": as_list(global_margin),
            "class_margin_client_max": as_list(client_best),
        }

register_algorithm("fedtgp", server=FedTGPServer, client=PrototypeClient, options=FedTGPOptions,
                   summary="trainable global prototypes, adaptive-margin contrastive learning (Zhang et al. 2024)",
                   private_release=True,
                   # 3 of 6 clients a round and 20 server epochs instead of 100: the run tests/e2e/test_runs.py
                   # also spreads over 4 ranks
                   conformance=ConformanceHints(overrides=("join_ratio=0.5", "algo.server_epochs=20"),
                                                ranks_checked_in="tests/e2e/test_runs.py, on 4 ranks with "
                                                                 "partial participation"))
