"""FedHKD (Chen, Wang and Vikalo, ICLR 2023): data-free hyper-knowledge distillation
(docs/algorithms.md, "FedHKD").

Each client uploads, per class j it holds, its "hyper-knowledge": the mean feature
H_i^j = mean f_i(x) and the mean soft prediction Q_i^j = mean softmax(h_i(f_i(x)) / T) over its
training samples of class j (taken after local training, in eval mode), with the class count
N_i^j. The server averages them per class weighted by the counts,

    H^j = Σ_i N_i^j H_i^j / Σ_i N_i^j,        Q^j = Σ_i N_i^j Q_i^j / Σ_i N_i^j,

and every client trains on

    L = CE(h(f(x)), y) + λ · (1/|A|) Σ_{j∈A} ‖softmax(h(H^j)/T) − Q^j‖₂
                       + γ · (1/B)  Σ_b [y_b∈A] ‖f(x_b) − H^{y_b}‖₂

(A: the classes with global hyper-knowledge; CE alone before there is any). The second term
distils the global soft predictions into the client's own head, evaluated on the global class
features; the third pulls the client's features towards them. Clients classify with their own head.

Adaptation to heterogeneous models: the paper (and its code, ``--upload_model True``) also averages
the client models every round, FedAvg-style; here the client architectures differ, so nothing but
the hyper-knowledge travels. The equations above are the paper's as recalled (its method section
could not be read, issue 47), so the defaults follow the one source that could be read, the
reference code (``compat=reference``: a KL/MSE loss, a server that keeps the last uploader's rows
and the rows of absent classes, gradient clipping at 1.1); ``compat=paper`` runs the equations.

Noise: the paper and its code can add N(0, σ²I) to each uploaded mean feature, with a fixed σ,
no clipping and no accounting, so without an (ε, δ) guarantee; that option is not offered. A
guarantee comes from the engine's accounted release (``privacy.*``), which is refused for this
algorithm for now: its soft predictions would go up un-noised.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    check_class_counts,
    check_class_rows,
    dense_class_table,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import (
    Batch,
    batch_cross_entropy,
    gradient_clipper,
    run_local_training,
    weighted_mean,
)
from htfl_dist.config import bounded
from htfl_dist.payload import Field, Payload, PayloadSpec

ClientLoss = Literal["paper", "reference"]
Aggregation = Literal["weighted", "last"]
KNOWLEDGE_BATCH = 512
"""Samples per forward pass when the hyper-knowledge is computed (no effect on the values)."""


REFERENCE_CLIP_GRAD_NORM = 1.1
"""CityChan/FedHKD clips the client model's gradient at norm 1.1 in its distillation rounds."""
REFERENCE_CODE = "CityChan/Federated-Hyper-Knowledge-Distillation@8a930f4"
"""The official code every default follows (its method section could not be read: issue 47)."""


@dataclass
class FedHKDOptions:
    compat: Compat = compat_option(added_later=True, default="reference")
    """reference (default; issue 47: the code is the one source that could be read): every knob
    left unset takes the code's value (CityChan/Federated-Hyper-Knowledge-Distillation@8a930f4):
    client_loss=reference (``Client/ClientFedHKD.py:update_weights_HKD``, KLDivLoss + MSELoss),
    aggregation=last and keep_absent=true (``Server/ServerFedHKD.py:train``, ``dict.update`` into
    dicts kept across rounds), clip_grad_norm=1.1 (``update_weights_HKD``). paper: the paper's
    equations as recalled, not read (mean L2 distances, count-weighted means, no clipping):
    paper, weighted, false, no clipping; what this engine ran before issue 47, so those runs keep
    their hash under it."""
    lam: float = bounded(0.05, at_least=0)
    """λ, the weight of the soft-prediction distillation term (the reference code's ``--lam``)."""
    gamma: float = bounded(0.05, at_least=0)
    """γ, the weight of the feature term (the reference code's ``--gamma``)."""
    temperature: float = bounded(0.5, above=0)
    """T of the soft predictions, in the uploads and in the distillation term (``--temp``)."""
    client_loss: ClientLoss | None = None
    """paper: λ·mean_j ‖softmax(h(H^j)/T) − Q^j‖₂ + γ·mean_b ‖f(x_b) − H^{y_b}‖₂; reference: the
    code's λ·KLDivLoss()(log softmax(h(H^j)/T), Q^j) (averaged over |A|·C entries) +
    γ·MSELoss()(f(x), H^y) (averaged over B·K, rows of classes without H^y count as 0)."""
    aggregation: Aggregation | None = None
    """weighted: the paper's count-weighted mean per class; last: the reference code's
    ``dict.update``, the last uploader of a class (in client-id order here) sets its row."""
    keep_absent: bool | None = None
    """Keep last round's row of a class nobody uploaded this round (the reference code's global
    dicts persist across rounds); False: such a class is absent from the download."""
    min_class_share: float = bounded(0.0, at_least=0, below=1)
    """ν: a client uploads class j only if N_i^j ≥ ν·N_i (0: every class it holds)."""
    clip_grad_norm: float | None = bounded(None, at_least=0, optional=True,
                                           note="0: no clipping; null: the compat preset's")
    """Clip the client model's gradient to this L2 norm before each step (the reference code
    clips at 1.1 in its distillation rounds); 0 or, under compat=paper, unset: no clipping."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.client_loss is None:
            self.client_loss = "reference" if reference else "paper"
        if self.aggregation is None:
            self.aggregation = "last" if reference else "weighted"
        if self.keep_absent is None:
            self.keep_absent = reference
        if self.clip_grad_norm is None and reference:
            self.clip_grad_norm = REFERENCE_CLIP_GRAD_NORM


def soft_predictions(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / T) per row."""
    return F.softmax(logits / temperature, dim=1)


def distillation_term(options: FedHKDOptions, head_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """λ-less distillation of the head's output on the global features (``head_logits`` [m, C])
    towards the global soft predictions Q (``targets`` [m, C]): the mean over the m rows of the
    L2 distance (paper), or KL(Q ‖ q) summed and divided by m·C (reference, ``nn.KLDivLoss()``)."""
    if options.client_loss != "reference":  # paper (None: unresolved options, read as paper)
        return torch.linalg.vector_norm(soft_predictions(head_logits, options.temperature) - targets, dim=1).mean()
    log_q = F.log_softmax(head_logits / options.temperature, dim=1)
    return F.kl_div(log_q, targets, reduction="sum") / head_logits.numel()


def feature_term(options: FedHKDOptions, features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor,
                 available: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """λ-less distance of each sample's features to its class's global feature, 0 for samples
    whose class has none, averaged over the batch: the L2 distance (paper) or the squared one
    divided by K (reference, ``nn.MSELoss()`` against the features themselves where absent)."""
    known = available[labels].unsqueeze(1)
    target = torch.where(known, table[labels], features.detach())
    difference = features - target
    if options.client_loss != "reference":  # paper (None: unresolved options, read as paper)
        per_sample = torch.linalg.vector_norm(difference, dim=1)
    else:
        per_sample = difference.pow(2).mean(dim=1)
    if weights is None:
        return per_sample.mean()
    return weighted_mean(per_sample, weights)


@torch.no_grad()
def hyper_knowledge(client: ClientState, num_classes: int, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(class ids [m], mean features [m, K], mean soft predictions [m, C], counts int64 [m]) over
    the client's training samples, in eval mode, for the m classes it holds (CPU)."""
    model = client.model
    was_training = model.training
    model.eval()
    features = ClassMeans(num_classes, model.feature_dim, client.device)
    soft = ClassMeans(num_classes, num_classes, client.device)
    for start in range(0, client.train_y.shape[0], KNOWLEDGE_BATCH):
        x, y = client.train_x[start : start + KNOWLEDGE_BATCH], client.train_y[start : start + KNOWLEDGE_BATCH]
        rows, logits = model.forward_with_features(x)
        features.add(rows, y)
        soft.add(soft_predictions(logits, temperature), y)
    model.train(was_training)
    class_ids, mean_features = features.rows()
    _, mean_soft = soft.rows()
    counts = features.weights[class_ids.to(features.weights.device)].round().to(torch.int64).cpu()
    return class_ids, mean_features, mean_soft, counts


def hyper_knowledge_fields(context: AlgorithmContext, with_counts: bool) -> PayloadSpec:
    """(class_ids [m], protos [m, K] mean features, soft [m, C] mean soft predictions[, counts [m]])."""
    c = context.num_classes
    fields = (Field("class_ids", torch.int64, max_rows=c), Field("protos", torch.float32, (context.feature_dim,), c),
              Field("soft", torch.float32, (c,), c))
    return fields + ((Field("counts", torch.int64, max_rows=c),) if with_counts else ())


class FedHKDClient(ClientAlgorithm):
    """CE + λ·distillation on the global class features + γ·feature pull; uploads (H_i, Q_i, N_i)."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return hyper_knowledge_fields(context, with_counts=True)

    def loss_function(self, client: ClientState, knowledge: Payload) -> Callable[[Batch], torch.Tensor]:
        """The round's objective for ``client`` (CE alone before any global hyper-knowledge)."""
        options, device = self.options, client.device
        if knowledge["class_ids"].numel() == 0:
            return batch_cross_entropy
        table, available = dense_class_table(knowledge, "protos", self.context.num_classes, device)
        global_features = knowledge["protos"].to(device)
        global_soft = knowledge["soft"].to(device)
        head = client.model.head

        def loss_fn(batch: Batch) -> torch.Tensor:
            distill = distillation_term(options, head(global_features), global_soft)
            pull = feature_term(options, batch.features, batch.labels, table, available, batch.weights)
            return batch_cross_entropy(batch) + options.lam * distill + options.gamma * pull

        return loss_fn

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_sum, seen = run_local_training(client, self.context, self.loss_function(client, knowledge), generator,
                                            before_step=gradient_clipper(client.model.parameters(),
                                                                         self.options.clip_grad_norm))
        return TrainResult(self.upload(client), loss_sum, seen)

    def upload(self, client: ClientState) -> Payload:
        """The client's hyper-knowledge after training, classes under ν·N_i left out."""
        options = self.options
        class_ids, features, soft, counts = hyper_knowledge(client, self.context.num_classes, options.temperature)
        kept = counts >= options.min_class_share * counts.sum()
        class_ids, features, soft, counts = class_ids[kept], features[kept], soft[kept], counts[kept]
        return {"class_ids": class_ids, "protos": features, "soft": soft, "counts": counts}

    def theory_upload_floats(self, client: ClientState) -> int:
        """(K + C)·|C_i|: a mean feature and a mean soft prediction per class uploaded, the classes
        held with at least ν·N_i samples (the class ids and counts travel as integers beside them)."""
        counts = torch.bincount(client.train_y, minlength=self.context.num_classes)[client.classes]
        uploaded = int((counts >= self.options.min_class_share * counts.sum()).sum())
        return (self.context.feature_dim + self.context.num_classes) * uploaded


class SoftKnowledgeServer(ServerAlgorithm):
    """What FedHKD and FedGMKD's servers share: the knowledge they keep and send down (a feature row
    and a soft prediction per known class), its bounds, the uploads' shape checks and the state.
    Only how the round's rows are combined (``update``) differs between them."""

    accepts_late_uploads = True  # a late upload is one more (weighted) row in its classes' means

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return hyper_knowledge_fields(context, with_counts=False)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.class_ids = torch.empty(0, dtype=torch.int64)
        self.protos = torch.empty(0, context.feature_dim)
        self.soft = torch.empty(0, context.num_classes)

    def download(self) -> Payload:
        return {"class_ids": self.class_ids, "protos": self.protos, "soft": self.soft}

    def theory_download_floats(self) -> int:
        """(K + C)·C: a feature and a soft prediction for every class."""
        return (self.context.feature_dim + self.context.num_classes) * self.context.num_classes

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        num_classes = self.context.num_classes
        check_class_rows(client_id, upload["class_ids"], upload["protos"], num_classes)
        check_class_rows(client_id, upload["class_ids"], upload["soft"], num_classes)
        check_class_counts(client_id, upload["class_ids"], upload["counts"])

    def state_dict(self) -> dict[str, Any]:
        return self.download()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.class_ids, self.protos, self.soft = state["class_ids"], state["protos"], state["soft"]


class FedHKDServer(SoftKnowledgeServer):
    """Per class, the count-weighted mean (or the last uploader's row) of the uploaded features and
    soft predictions."""

    def aggregate(self, uploads: dict[int, Payload]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(present [C] bool, features [C, K], soft [C, C]) of this round's uploads, float64."""
        c, k = self.context.num_classes, self.context.feature_dim
        if self.options.aggregation == "last":
            present = torch.zeros(c, dtype=torch.bool)
            features, soft = torch.zeros(c, k, dtype=torch.float64), torch.zeros(c, c, dtype=torch.float64)
            for client_id in sorted(uploads):  # a later client overwrites an earlier one's class
                upload = uploads[client_id]
                ids = upload["class_ids"]
                present[ids] = True
                features[ids], soft[ids] = upload["protos"].double(), upload["soft"].double()
            return present, features, soft
        feature_means = ClassMeans(c, k, dtype=torch.float64)
        soft_means = ClassMeans(c, c, dtype=torch.float64)
        for client_id in sorted(uploads):  # fixed order: the float64 sums do not depend on ranks
            upload = uploads[client_id]
            feature_means.add(upload["protos"], upload["class_ids"], upload["counts"])
            soft_means.add(upload["soft"], upload["class_ids"], upload["counts"])
        return feature_means.present(), feature_means.dense(), soft_means.dense()

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        previous = self.download()
        present, features, soft = self.aggregate(uploads)
        if self.options.keep_absent and previous["class_ids"].numel():
            old = previous["class_ids"]
            kept = old[~present[old]]
            features[kept], soft[kept] = previous["protos"][~present[old]].double(), \
                previous["soft"][~present[old]].double()
            present[kept] = True
        self.class_ids = torch.nonzero(present).flatten()
        self.protos, self.soft = features[self.class_ids].float(), soft[self.class_ids].float()
        return {"global_classes": float(self.class_ids.numel()),
                **global_prototype_diagnostics(uploads, self.context.num_classes, self.download(), previous)}

register_algorithm("fedhkd", server=FedHKDServer, client=FedHKDClient, options=FedHKDOptions,
                   summary="per-class mean features and soft predictions, distilled into each client's "
                           "head and features (Chen et al. 2023)")
