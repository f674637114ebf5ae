"""FedGMKD (Zhang, Shan and Han, NeurIPS 2024): Cluster Knowledge Fusion on the clients,
Discrepancy-Aware aggregation on the server (docs/algorithms.md, "FedGMKD").

After local training, client i computes for every class c it holds, over its training samples
of that class in eval mode, the prototype P_i^c = Σ_j π_j·μ_j of a Gaussian mixture fitted to the
class's features (``fedgmkd_mixture``) and the mean soft prediction Q_i^c = mean softmax(h(f(x))/T),
and uploads them with its class counts. The server weighs client i's rows of class c by

    w_i^c ∝ ReLU(n_i − a·d_i^c + b),     d_i^c = KL(softmax(G^c) ‖ softmax(P_i^c)) / K,

n_i the client's sample count and G^c last round's global prototype (d = 0 where there is none),
normalised over the class's uploaders, and sends G^c = Σ_i w_i^c·P_i^c, S^c = Σ_i w_i^c·Q_i^c.
Clients train on

    L = CE(h(f(x)), y) + λ·KL(S ‖ softmax(h(G)/T)) / (|A|·C) + γ·MSE(f(x), G^y)

(A: the classes with a global row; a sample whose class has none is compared with itself), their
gradient clipped to norm 1.1; CE alone, unclipped, before any global row exists. Defaults are the
official code's (SereinZY/FedGMKD@bd673b0): the paper's text could not be read here.

Adaptation to heterogeneous models: the reference also averages the client models every round
(``upload_model=True``) with weights from each client's label skew; here only the class
knowledge travels and each client keeps its own model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import (
    dense_class_table,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.fedgmkd_mixture import mixture_prototype
from htfl_dist.algorithms.fedhkd import SoftKnowledgeServer
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, TrainResult
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import (
    Batch,
    batch_cross_entropy,
    gradient_clipper,
    run_local_training,
    weighted_mean,
)
from htfl_dist.config import bounded
from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import torch_generator

Normalise = Literal["holders", "participants"]
Prototype = Literal["mixture", "mean", "standardised_mixture"]
KNOWLEDGE_BATCH = 512
"""Samples per forward pass when the knowledge is computed (no effect on the values)."""


@dataclass
class FedGMKDOptions:
    """Defaults: the official code (SereinZY/FedGMKD@bd673b0); docs/algorithms.md lists each source."""

    lam: float = bounded(0.06, at_least=0)
    """λ of the soft-prediction term (``option.py --lam``)."""
    gamma: float = bounded(0.06, at_least=0)
    """γ of the feature term (``option.py --gamma``)."""
    temperature: float = bounded(0.6, above=0)
    """T of the soft predictions, uploaded and distilled (``option.py --temp``)."""
    discrepancy_weight: float = bounded(0.4, at_least=0)
    """a in ReLU(n_i − a·d_i^c + b) (``ServerFedGMKD.train``: ``param_a = 0.4`` for the class weights)."""
    quantity_offset: float = bounded(0.2, at_least=0)
    """b in ReLU(n_i − a·d_i^c + b) (``ServerFedGMKD.train``: ``param_b = 0.2``)."""
    normalise: Normalise = "holders"
    """holders: w_i^c sums to 1 over the uploaders of class c; participants: over every uploader of
    the round, the others scoring n_j + b, so a class few hold shrinks (the reference's sum)."""
    clip_grad_norm: float | None = bounded(1.1, at_least=0, optional=True, note="0 or null: no clipping")
    """Gradient-norm clip in the rounds with global knowledge (``update_weights_GMKD``, ``max_norm=1.1``)."""
    prototype: Prototype = "mixture"
    """mixture: Σπμ of the fitted mixture in feature space (the class mean up to rounding, see
    ``fedgmkd_mixture``); mean: the class mean without the fit; standardised_mixture: Σπμ of
    the standardised features, never mapped back (the reference's, ≈ 0)."""
    mixture_components: int = bounded(6, at_least=1)
    """Fits with 1..min(n, this) components, lowest BIC kept (``local_CKF_aggregation``: ``min(len, 6)``)."""
    mixture_iterations: int = bounded(10, at_least=1)
    """EM iterations at most per fit. Departs from the reference's 100 (scikit-learn's ``max_iter``):
    the upload Σπμ is the class mean after any M-step, so more iterations move only the mixture."""
    mixture_tolerance: float = bounded(1e-3, above=0)
    """EM stops when the mean log-likelihood moves by less (scikit-learn ``tol=1e-3``)."""


# --------------------------------------------------------------------------- the server's maths


def feature_discrepancy(global_rows: torch.Tensor, local_rows: torch.Tensor) -> torch.Tensor:
    """d [m] per row pair [m, K]: KL(softmax(g) ‖ softmax(p)) / K, the reference's
    ``F.kl_div(F.log_softmax(local), F.softmax(global))`` with its default mean over the K entries."""
    log_global = F.log_softmax(global_rows.double(), dim=1)
    log_local = F.log_softmax(local_rows.double(), dim=1)
    return (log_global.exp() * (log_global - log_local)).sum(dim=1) / global_rows.shape[1]


def aggregation_weights(totals: torch.Tensor, discrepancies: torch.Tensor, holds: torch.Tensor,
                        a: float, b: float, normalise: Normalise) -> torch.Tensor:
    """w [n, C] of n uploaders: score_i^c = ReLU(n_i − a·d_i^c + b) (``totals`` [n] the n_i,
    ``discrepancies`` [n, C], 0 where undefined), kept where client i holds c (``holds`` [n, C]) and
    divided per class by the holders' scores, or by every uploader's (``participants``). A class
    whose holders all score 0 gets no weight (it is left out of the download)."""
    scores = torch.relu(totals.double().unsqueeze(1) - a * discrepancies.double() + b)
    numerators = torch.where(holds, scores, torch.zeros_like(scores))
    denominators = (numerators if normalise == "holders" else scores).sum(dim=0)
    alive = numerators.sum(dim=0) > 0
    return torch.where(alive, numerators / torch.where(alive, denominators, torch.ones_like(denominators)),
                       torch.zeros_like(numerators))


# --------------------------------------------------------------------------- the client


def distillation_term(head_logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(S ‖ softmax(h(G)/T)) summed over the m×C entries and divided by m·C: ``nn.KLDivLoss()``
    (mean reduction) of the reference, on the head's logits of the global prototypes [m, C]."""
    log_q = F.log_softmax(head_logits / temperature, dim=1)
    return F.kl_div(log_q, targets, reduction="sum") / head_logits.numel()


def feature_term(features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, available: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.MSELoss()`` of f(x) against G^y over B·K entries; a sample whose class has no global
    row is compared with its own detached features (adds 0, counts in B), as the reference does."""
    target = torch.where(available[labels].unsqueeze(1), table[labels], features.detach())
    per_sample = (features - target).pow(2).mean(dim=1)
    return per_sample.mean() if weights is None else weighted_mean(per_sample, weights)


class FedGMKDClient(ClientAlgorithm):
    """CE + λ·KL on the global prototypes through the own head + γ·MSE to them; uploads the
    mixture prototypes, mean soft predictions and class counts."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        c = context.num_classes
        return (Field("class_ids", torch.int64, max_rows=c), Field("counts", torch.int64, max_rows=c),
                Field("protos", torch.float32, (context.feature_dim,), c), Field("soft", torch.float32, (c,), c))

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options, device = self.options, client.device
        if knowledge["class_ids"].numel() == 0:  # round 1: CE alone, unclipped (``update_weights``)
            loss_sum, seen = run_local_training(client, self.context, batch_cross_entropy, generator)
            return TrainResult(self.knowledge(client, round_index), loss_sum, seen)
        table, available = dense_class_table(knowledge, "protos", self.context.num_classes, device)
        global_protos, global_soft = knowledge["protos"].to(device), knowledge["soft"].to(device)
        head = client.model.head

        def loss_fn(batch: Batch) -> torch.Tensor:
            distill = distillation_term(head(global_protos), global_soft, options.temperature)
            pull = feature_term(batch.features, batch.labels, table, available, batch.weights)
            return batch_cross_entropy(batch) + options.lam * distill + options.gamma * pull

        clip = gradient_clipper(client.model.parameters(), options.clip_grad_norm)
        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator, before_step=clip)
        return TrainResult(self.knowledge(client, round_index), loss_sum, seen)

    @torch.no_grad()
    def knowledge(self, client: ClientState, round_index: int) -> Payload:
        """Per class held (sorted): count, prototype (``algo.prototype``) and mean soft prediction
        over the client's training split, in eval mode. Each class's mixture draws its initial
        means from its own stream (seed, client, round, class)."""
        options, model = self.options, client.model
        was_training = model.training
        model.eval()
        feature_parts, soft_parts = [], []
        for start in range(0, client.train_y.shape[0], KNOWLEDGE_BATCH):
            features, logits = model.forward_with_features(client.train_x[start : start + KNOWLEDGE_BATCH])
            feature_parts.append(features.double())
            soft_parts.append(F.softmax(logits.double() / options.temperature, dim=1))
        model.train(was_training)
        features, soft, labels = torch.cat(feature_parts), torch.cat(soft_parts), client.train_y
        class_ids = torch.unique(labels)
        protos, means, counts = [], [], []
        for class_id in class_ids.tolist():
            mine = labels == class_id
            counts.append(int(mine.sum()))
            means.append(soft[mine].mean(dim=0))
            protos.append(self.prototype(features[mine], client.client_id, round_index, class_id))
        return {"class_ids": class_ids.cpu(), "counts": torch.tensor(counts, dtype=torch.int64),
                "protos": torch.stack(protos).float().cpu(), "soft": torch.stack(means).float().cpu()}

    def prototype(self, rows: torch.Tensor, client_id: int, round_index: int, class_id: int) -> torch.Tensor:
        """One class's uploaded prototype [K] from its features ``rows`` [n, K] (float64)."""
        options = self.options
        if options.prototype == "mean":
            return rows.mean(dim=0)
        generator = torch_generator(self.context.seed, "fedgmkd_mixture", client_id, round_index, class_id)
        prototype, _ = mixture_prototype(rows.cpu(), options.mixture_components, options.mixture_iterations,
                                         options.mixture_tolerance, generator,
                                         standardised=options.prototype == "standardised_mixture")
        return prototype.to(rows.device)

    def theory_upload_floats(self, client: ClientState) -> int:
        """(K + C)·|C_i|: a prototype and a mean soft prediction per class held (ids and counts
        travel as integers beside them)."""
        return (self.context.feature_dim + self.context.num_classes) * int(client.classes.numel())


# --------------------------------------------------------------------------- the server


class FedGMKDServer(SoftKnowledgeServer):
    """Discrepancy-aware weighted means of the round's prototypes and soft predictions, per class."""

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        super().validate_upload(client_id, upload)
        soft = upload["soft"].double()
        if soft.numel() and (bool((soft < 0).any()) or float((soft.sum(dim=1) - 1).abs().max()) > 1e-3):
            raise ProtocolError(f"client {client_id} sent soft predictions that are not distributions")

    def weights(self, uploads: list[Payload], discrepancy: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w [n, C], d [n, C], compared [n, C]) of the round's uploads in client-id order against
        last round's global prototypes (d = 0 where a class had none, or with ``discrepancy=False``)."""
        c = self.context.num_classes
        previous, known = dense_class_table(self.download(), "protos", c)
        holds = torch.zeros(len(uploads), c, dtype=torch.bool)
        compared = torch.zeros(len(uploads), c, dtype=torch.bool)
        distances = torch.zeros(len(uploads), c, dtype=torch.float64)
        for row, upload in enumerate(uploads):
            ids = upload["class_ids"]
            holds[row, ids] = True
            mine = known[ids]
            if discrepancy and bool(mine.any()):
                compared[row, ids[mine]] = True
                distances[row, ids[mine]] = feature_discrepancy(previous[ids[mine]], upload["protos"][mine])
        totals = torch.tensor([float(upload["counts"].sum()) for upload in uploads], dtype=torch.float64)
        options = self.options
        return aggregation_weights(totals, distances, holds, options.discrepancy_weight, options.quantity_offset,
                                   options.normalise), distances, compared

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        order = [uploads[client_id] for client_id in sorted(uploads)]  # fixed order: float64 sums rank-free
        weights, distances, compared = self.weights(order)
        plain, _, _ = self.weights(order, discrepancy=False)
        c, k = self.context.num_classes, self.context.feature_dim
        protos, soft = torch.zeros(c, k, dtype=torch.float64), torch.zeros(c, c, dtype=torch.float64)
        for row, upload in enumerate(order):
            ids = upload["class_ids"]
            protos[ids] += weights[row, ids].unsqueeze(1) * upload["protos"].double()
            soft[ids] += weights[row, ids].unsqueeze(1) * upload["soft"].double()
        previous = self.download()
        self.class_ids = torch.nonzero(weights.sum(dim=0) > 0).flatten()
        self.protos, self.soft = protos[self.class_ids].float(), soft[self.class_ids].float()
        diagnostics = {"global_classes": float(self.class_ids.numel()),
                       "weight_shift_max": float((weights - plain).abs().max())}
        if bool(compared.any()):
            diagnostics["discrepancy_mean"] = float(distances[compared].mean())
        return {**diagnostics, **global_prototype_diagnostics(uploads, c, self.download(), previous)}

register_algorithm("fedgmkd", server=FedGMKDServer, client=FedGMKDClient, options=FedGMKDOptions,
                   summary="Gaussian-mixture class prototypes and soft predictions, aggregated with "
                           "discrepancy-aware weights and distilled into each client (Zhang et al. 2024)",
                   conformance=ConformanceHints())  # launched on 3 ranks itself: its mixtures' streams are per class
