"""FedORGP (Guo et al., arXiv 2502.16119 v2, 2025): version 2 of FedOC's paper, the method renamed
(docs/algorithms.md, "FedOC and FedORGP"), as FedOC's classes (``algorithms/fedoc.py``) with the
two switches its authors' code added in July 2025 and turns on by default, which the paper's text
does not describe: the client drops outlying features of each class before taking its mean
(:func:`outlier_mask`), and the server weighs both terms of its loss with sigmoids of the cosines
(:func:`weighted_orthogonality_loss`). Its d is normalised by |B|·(|C| − 1) (FedORGP Eq. 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.fedoc import FedOCClient, FedOCOptions, FedOCServer, InterNorm, cosine_table
from htfl_dist.algorithms.fedproto import ProtoSamples
from htfl_dist.algorithms.interface import ClientState
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.config import bounded

OutlierFilter = Literal["adaptive", "none"]
LossWeights = Literal["sigmoid", "uniform"]
SIGMOID_THRESHOLD, SIGMOID_TEMPERATURE = 0.3, 0.5
"""τ and T of the weights w(x) = 1 + σ((x − τ)/T) (fixed in the reference code)."""
SMALL_CLASS = 2
"""A class with at most this many samples keeps them all (the reference's guard)."""
IQR_FENCE = 1.5
"""Tukey's fences: keep a score within [Q1 − 1.5·IQR, Q3 + 1.5·IQR]."""
ALPHA_STEP, ALPHA_SLOPE = 0.3, 0.5
"""a = α·(1 − 0.3·tanh(0.5·(ρ − 1))), the adaptive mixing weight of the filter's two scores."""
ALPHA_MIN, ALPHA_MAX = 0.1, 0.9
"""The range a is clamped to."""
FILTER_EPS = 1e-8
"""The guard of every division in the filter (the reference's)."""


@dataclass
class FedORGPOptions(FedOCOptions):
    """FedOC's options (same defaults, the paper's), plus the two parts the authors' code adds and
    runs by default (wisheverybodyhapi/FedORGP ff4a036, ``-abc``/``-abs`` off), and which samples
    the uploaded means cover. ``compat=reference`` resolves what FedOC's does (reg_weight 10, the
    client batch on the server, CE only in round 1) and ``proto_samples=full_batches``. inter_norm
    resolves to other_classes under both: FedORGP's Eq. 4 divides by |B|·(|C| − 1), as the code."""

    outlier_filter: OutlierFilter = "adaptive"
    """adaptive: before a class's mean is taken, its features whose combined distance/cosine score
    falls outside Tukey's fences are dropped (the code's ``filter_outliers_multi_metric``); none:
    the plain mean (FedOC's, the code's ``-abc`` ablation)."""
    filter_alpha: float = bounded(0.5, at_least=0, at_most=1)
    """α, the filter's base weight of the distance score against the cosine score (the code's
    ``-al``, 0.5)."""
    loss_weights: LossWeights = "sigmoid"
    """sigmoid: each term of the server's L_OR weighted by w(x) = 1 + σ((x − 0.3)/0.5) of the
    cosines involved (the code's adaptive losses); uniform: FedOC's unweighted L_OC (the code's
    ``-abs`` ablation)."""
    proto_samples: ProtoSamples | None = None
    """Which training samples enter the uploaded means: all of them (paper Eq. 2); full_batches,
    the samples of the full batches in stored order (htfllib: the code collects them through its
    ``DataLoader(shuffle=False, drop_last=True)``)."""

    def validate(self) -> None:
        if self.inter_norm is None:
            self.inter_norm = "other_classes"
        if self.proto_samples is None:
            self.proto_samples = "full_batches" if self.compat == "reference" else "all"
        super().validate()


def sigmoid_weights(similarity: torch.Tensor) -> torch.Tensor:
    """w(x) = 1 + σ((x − τ)/T), τ = 0.3, T = 0.5: in (1, 2), 1.5 at x = τ, growing with x."""
    return 1 + torch.sigmoid((similarity - SIGMOID_THRESHOLD) / SIGMOID_TEMPERATURE)


def weighted_orthogonality_loss(pairs: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor,
                                intra_weight: float, inter_weight: float, inter_norm: InterNorm) -> torch.Tensor:
    """FedORGP's server loss with the reference code's sigmoid weights, on a mini-batch of pairs:

        A_bc̄ = |cos(P_b, P̂^c̄)|,   o_b = (1/(C − 1)) Σ_{c̄≠c_b} A_bc̄
        s_w = (1/|B|) Σ_b w(o_b)·(1 − cos(P_b, P̂^{c_b}))
        d_w = (1/(|B|·n)) Σ_b Σ_{c̄≠c_b} w(A_bc̄)·A_bc̄          n as in :func:`orthogonality_loss`
        L = λ_s·s_w + γ·d_w

    A pair already close to another class (large o_b) pulls harder towards its own prototype, and a
    large |cos| to another class is pushed harder. The weights are not detached: the gradient
    flows through them too, as in the code. With w ≡ 1 this is FedOC's L_OC."""
    cos = cosine_table(pairs, global_protos)
    batch, num_classes = cos.shape
    own = F.one_hot(labels, num_classes).bool()
    others = cos.abs().masked_fill(own, 0.0)
    spread = max(num_classes - 1, 1)
    distance = 1 - cos.gather(1, labels.unsqueeze(1)).squeeze(1)
    intra = (distance * sigmoid_weights(others.sum(dim=1) / spread)).mean()
    count = num_classes if inter_norm == "all_classes" else spread
    inter = (others * sigmoid_weights(others)).sum() / (batch * count)
    return intra_weight * intra + inter_weight * inter


def _variation(values: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """The coefficient of variation std/mean (unbiased std), each clamped at ε."""
    return values.std().clamp(min=FILTER_EPS) / mean.clamp(min=FILTER_EPS)


def _unit_range(values: torch.Tensor) -> torch.Tensor:
    """(x − min)/(max − min + ε): the values min-max scaled to [0, 1)."""
    return (values - values.min()) / (values.max() - values.min() + FILTER_EPS)


def outlier_scores(features: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """The filter's score of each of one class's n features f_j [n, K], and its mixing weight a:

        μ = (1/n) Σ_j f_j,   d_j = ‖f_j − μ‖₂,   c_j = cos(f_j, μ)
        ρ = cv(d) / cv(c),   cv(x) = std(x) / |mean(x)|           (unbiased std; both clamped at ε)
        a = clamp(α·(1 − 0.3·tanh(0.5·(ρ − 1))), 0.1, 0.9)
        s_j = a·(1 − minmax(d)_j) + (1 − a)·minmax(c)_j,   minmax(x) = (x − min x)/(max x − min x + ε)

    so s_j is high for a feature near the class centre and aligned with it. The distance score
    weighs less (a < α) when the distances vary more than the cosines do. (The reference also
    clamps α's factor to [0.4, 1.6]; it lies in (0.7, 1.3) anyway.)"""
    centre = features.mean(dim=0)
    distances = (features - centre).norm(dim=1)
    cosines = F.normalize(features, dim=1) @ F.normalize(centre, dim=0)
    ratio = _variation(distances, distances.mean()) / _variation(cosines, cosines.mean().abs())
    factor = 1 - ALPHA_STEP * torch.tanh(ALPHA_SLOPE * (ratio - 1))
    weight = float((alpha * factor).clamp(ALPHA_MIN, ALPHA_MAX))
    return weight * (1 - _unit_range(distances)) + (1 - weight) * _unit_range(cosines), weight


def outlier_mask(features: torch.Tensor, alpha: float) -> torch.Tensor:
    """Which of one class's features [n, K] the client keeps ([n] bool): all of them when n ≤ 2;
    else those whose :func:`outlier_scores` lie within Tukey's fences,
    Q1 − 1.5·IQR ≤ s_j ≤ Q3 + 1.5·IQR (quartiles by linear interpolation). The fences are
    two-sided: a feature much *closer* to the centre than the rest goes too.

    The reference then keeps the ⌊n/2⌋ best scores if fewer than that survive, and the best one if
    none does. Neither fires in exact arithmetic, so neither is written here: the scores ranked
    between the quartiles survive (only ⌊n/2⌋ − 1 of them for n = 4k + 2), and so does one of the
    two ranked next to them, or both for n = 4k + 2: at least ⌊n/2⌋ + 1 in all (docs/algorithms.md,
    "FedORGP", gives the count)."""
    count = features.shape[0]
    if count <= SMALL_CLASS:
        return torch.ones(count, dtype=torch.bool, device=features.device)
    scores, _ = outlier_scores(features, alpha)
    q1, q3 = torch.quantile(scores, torch.tensor([0.25, 0.75], dtype=scores.dtype, device=scores.device))
    fence = IQR_FENCE * (q3 - q1)
    return (scores >= q1 - fence) & (scores <= q3 + fence)


def filtered_class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int,
                         alpha: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(class ids int64 [m], means [m, K]) on the CPU for the m classes present in ``labels``: the
    mean of each class's features, after :func:`outlier_mask` unless ``alpha`` is None."""
    class_ids, rows = [], []
    for label in range(num_classes):
        members = features[labels == label]
        if members.shape[0] == 0:
            continue
        if alpha is not None:
            members = members[outlier_mask(members, alpha)]
        class_ids.append(label)
        rows.append(members.mean(dim=0))
    if not rows:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, features.shape[1])
    return torch.tensor(class_ids, dtype=torch.int64), torch.stack(rows).float().cpu()


@torch.no_grad()
def training_features(client: ClientState, count: int, feature_dim: int, batch_size: int = 512) -> torch.Tensor:
    """f_i(x) of the client's first ``count`` training samples, in eval mode ([count, K])."""
    model = client.model
    was_training = model.training
    model.eval()
    rows = [model.features(client.train_x[start:min(start + batch_size, count)])
            for start in range(0, count, batch_size)]
    model.train(was_training)
    return torch.cat(rows) if rows else torch.empty(0, feature_dim, device=client.device)


class FedORGPClient(FedOCClient):
    """FedOC's client (CE + λ_c·(1 − cos) training, own-head inference); its uploaded means leave
    out each class's outlying features (``outlier_filter``) and cover the samples ``proto_samples``
    says."""

    def local_prototypes(self, client: ClientState) -> tuple[torch.Tensor, torch.Tensor]:
        options, context = self.options, self.context
        if options.outlier_filter == "none" and options.proto_samples == "all":
            return super().local_prototypes(client)
        count = client.train_y.shape[0]
        if options.proto_samples == "full_batches":
            count -= count % context.train.batch_size  # not one full batch: nothing goes up
        features = training_features(client, count, context.feature_dim)
        alpha = options.filter_alpha if options.outlier_filter == "adaptive" else None
        return filtered_class_means(features, client.train_y[:count].to(features.device), context.num_classes, alpha)


class FedORGPServer(FedOCServer):
    """FedOC's server, trained with the sigmoid-weighted loss (``loss_weights=sigmoid``)."""

    def fit(self, pairs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> dict:
        options = self.options
        if options.loss_weights == "uniform":
            return super().fit(pairs, labels, generator)

        def loss_fn(rows: torch.Tensor, batch_labels: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
            return weighted_orthogonality_loss(rows, batch_labels, protos, options.intra_weight,
                                               options.inter_weight, options.inter_norm)

        server_loss = self.train_prototypes(pairs, labels, loss_fn, generator)
        return {"server_loss": server_loss, "server_pairs": int(pairs.shape[0])}


register_algorithm("fedorgp", server=FedORGPServer, client=FedORGPClient, options=FedORGPOptions,
                   summary="FedOC's paper in its v2 (arXiv 2502.16119, renamed FedORGP) with its authors' later "
                           "code: outlier-filtered client prototypes and a sigmoid-weighted orthogonality loss",
                   # not private_release: which features enter a mean depends on all of the class's
                   # samples, which the release's per-sample sensitivity does not cover
                   conformance=ConformanceHints(overrides=("join_ratio=0.5",), ranks_covered_by="fedoc"))
