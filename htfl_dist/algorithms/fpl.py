"""FPL (Huang, Ye, Shi, Li and Du, CVPR 2023, "Rethinking Federated Learning with Domain Shift: A
Prototype View"): cluster prototypes and unbiased prototypes (docs/algorithms.md, "FPL").

Clients upload P_i^c, the mean of f_i(x) over their samples of class c, for the classes they
hold: by default, as the reference code, the features of the batches of the last local epoch,
each taken in train mode before its step. The server, per class c, clusters that class's uploads
(in client-id order) with FINCH
(:func:`finch`: every point joins its first neighbour by cosine distance, the connected
components are the clusters, and the clustering recurses on the clusters' means) and keeps one
partition: the coarsest one FINCH returns, as the reference code does. What goes down, per class:

- the cluster prototypes Ĉ^c: the mean of the uploads in each cluster (a variable number of rows
  per class, at most one per uploader: at most C·N rows in all);
- the unbiased prototype Ũ^c = (1/|Ĉ^c|) Σ_{ĉ ∈ Ĉ^c} ĉ, the plain mean of the cluster prototypes
  (every cluster weighs the same, however many clients it holds).

Clients train, with z = f_i(x) and y its label, s(a, b) the cosine similarity and τ the temperature,

    FPCL(z, y) = −log [ Σ_{ĉ ∈ Ĉ^y} e^{s(z, ĉ)/τ} / Σ_{ĉ ∈ Ĉ} e^{s(z, ĉ)/τ} ]
    UPCR(z, y) = (1/K) Σ_k (z_k − Ũ^y_k)²  (the reference's MSE; upcr_reduction=sum: without 1/K)
    L = CE(h_i(z), y) + (1/B) Σ_{samples whose class has prototypes} [FPCL + UPCR]

(Ĉ every class's cluster prototypes; the sum over samples is divided by the whole batch, as the
reference code does). Before the first download a client trains with CE alone. Inference is the
client's own head. The paper shares the whole model too (FedAvg, one architecture for all);
here every client keeps its own architecture and only prototypes travel.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.batches import samples_per_epoch
from htfl_dist.algorithms.class_rows import check_class_rows, dense_prototypes, global_prototype_diagnostics
from htfl_dist.algorithms.fedproto import PrototypeClient, PrototypeSource
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState, ServerAlgorithm
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, batch_cross_entropy, weighted_mean
from htfl_dist.config import TrainConfig, bounded
from htfl_dist.config.rules import Identity, declared
from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec

UPCRReduction = Literal["sum", "mean"]
FinchPartition = Literal["coarsest", "finest"]
ProtoEpochs = Literal["last", "all"]


@dataclass
class FPLOptions:
    tau: float = bounded(0.02, above=0)
    """τ, the temperature of FPCL (the reference code's ``--infoNCET`` default)."""
    fpcl_weight: float = bounded(1.0, at_least=0)
    """Weight of FPCL in the loss (1: the paper's plain sum; 0: the "w/o FPCL" ablation)."""
    upcr_weight: float = bounded(1.0, at_least=0)
    """Weight of UPCR in the loss (1: the paper's plain sum; 0: the "w/o UPCR" ablation)."""
    upcr_reduction: UPCRReduction = "mean"
    """mean: Σ_k (z_k − Ũ^y_k)² / K, the reference code's ``nn.MSELoss()`` on one sample (the
    default, as the paper's own equation could not be read here); sum: the squared distance,
    one reading of the paper's regulariser."""
    finch_partition: FinchPartition = "coarsest"
    """Which FINCH partition gives the cluster prototypes: the last (coarsest) one FINCH returns,
    as the reference code takes it (``c[:, -1]``), or the first (finest, first-neighbour links only)."""
    proto_from: PrototypeSource = "during_training"
    """When the uploaded means are taken: during_training, the class means of the features of the
    batches trained on, in train mode, each taken before its step (the reference code's:
    WenkeHuang/RethinkFL@74201b3 ``models/fpl.py:FPL._train_net`` appends ``f[i, :]`` per label
    and ``agg_func`` averages them); post_update, an eval-mode pass of the trained model over the
    split (a reading of the paper's abstract, the default before issue 47); pre_update, before."""
    proto_epochs: ProtoEpochs = declared("last", identity=Identity(added_later=True, before="all"))
    """With proto_from=during_training, which local epochs' batches: last, those of the last local
    epoch only (the reference's ``if iter == self.local_epoch - 1``); all, those of every epoch
    (HtFLlib FedProto's rule, what during_training averaged before issue 47). The same at
    ``train.local_epochs=1``."""



# ------------------------------------------------------------------------------------ FINCH

def first_neighbours(points: torch.Tensor) -> torch.Tensor:
    """κ(i) = argmin_{j ≠ i} (1 − cos(x_i, x_j)) for rows x [n, D]: each point's first neighbour by
    cosine distance, ties to the lowest index (numpy's argmin in the reference code). A zero row has
    cosine 0 with everything. One point is its own neighbour. Returns int64 [n]."""
    units = F.normalize(points.double(), dim=1)
    cosines = units @ units.t()
    if points.shape[0] > 1:
        cosines.fill_diagonal_(float("-inf"))
    # the first of the largest cosines: largest value, then the smallest index holding it
    best = cosines.max(dim=1, keepdim=True).values
    index = torch.arange(points.shape[0]).expand_as(cosines)
    return torch.where(cosines == best, index, points.shape[0]).min(dim=1).values


def linked_components(neighbours: torch.Tensor) -> torch.Tensor:
    """Connected components of the graph with an edge i — κ(i) for every i (FINCH's clustering
    equation: i and j together when j = κ(i), i = κ(j) or κ(i) = κ(j), whose components are these).
    Labels 0, 1, ... in the order of each component's smallest member. Returns int64 [n]."""
    parent = list(range(neighbours.shape[0]))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in enumerate(neighbours.tolist()):
        a, b = root(i), root(j)
        parent[max(a, b)] = min(a, b)  # the smaller index roots the component
    labels: dict[int, int] = {}
    return torch.tensor([labels.setdefault(root(i), len(labels)) for i in range(len(parent))], dtype=torch.int64)


def cluster_means(points: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of the rows of each label 0..max: [k, D], in label order."""
    count = int(labels.max()) + 1
    sums = torch.zeros(count, points.shape[1], dtype=points.dtype).index_add_(0, labels, points)
    return sums / torch.bincount(labels, minlength=count).unsqueeze(1).to(points.dtype)


def finch(points: torch.Tensor) -> list[torch.Tensor]:
    """FINCH (Sarfraz et al., CVPR 2019) without its optional early-exit threshold, as the FPL
    reference calls it (cosine distance, ``ensure_early_exit=False``): partition 0 links every
    point to its first neighbour; partition p + 1 links partition p's clusters, each represented by
    the mean of its member points, the same way and merges what is linked. It stops before a
    partition with one cluster, or one that merges nothing. Returns the partitions, finest first,
    each as one label per point (labels ordered by smallest member)."""
    labels = linked_components(first_neighbours(points))
    partitions = [labels]
    while True:
        merged = linked_components(first_neighbours(cluster_means(points, labels)))[labels]
        count, before = int(merged.max()) + 1, int(labels.max()) + 1
        if count == 1 or count >= before:
            return partitions
        partitions.append(merged)
        labels = merged


def class_clusters(protos: torch.Tensor, partition: FinchPartition) -> torch.Tensor:
    """Ĉ^c: the means of one class's uploads [n, K] over the clusters of the chosen FINCH
    partition, [k, K] in order of each cluster's first upload."""
    partitions = finch(protos)
    return cluster_means(protos, partitions[-1] if partition == "coarsest" else partitions[0])


# ------------------------------------------------------------------------------------ the wire

def fpl_download_fields(context: AlgorithmContext) -> PayloadSpec:
    """The unbiased prototypes (``class_ids``, ``protos``: at most C rows, one per class) and the
    cluster prototypes (``cluster_class_ids``, ``cluster_protos``: at most one per uploader of each
    class, so at most C·N rows)."""
    most = context.num_classes * max(context.num_clients, 1)
    width = context.feature_dim
    return (Field("class_ids", torch.int64, max_rows=context.num_classes),
            Field("protos", torch.float32, (width,), context.num_classes),
            Field("cluster_class_ids", torch.int64, max_rows=most),
            Field("cluster_protos", torch.float32, (width,), most))


def check_download(knowledge: Payload, context: AlgorithmContext) -> None:
    """Refuse a download that the server cannot truthfully have sent; every bound comes from the
    run (C, N, K), none from the message: unbiased rows are class-indexed rows (distinct classes in
    [0, C)); cluster rows have class ids in [0, C), at most N per class, and the classes with
    cluster rows are exactly those with an unbiased prototype."""
    num_classes, clients, width = context.num_classes, max(context.num_clients, 1), context.feature_dim
    class_ids, protos = knowledge["class_ids"], knowledge["protos"]
    cluster_ids, clusters = knowledge["cluster_class_ids"], knowledge["cluster_protos"]
    check_class_rows("the server", class_ids, protos, num_classes)  # the unbiased prototypes
    if cluster_ids.dim() != 1 or cluster_ids.shape[0] != clusters.shape[0]:
        raise ProtocolError(f"the server sent {tuple(cluster_ids.shape)} cluster class ids for "
                            f"{clusters.shape[0]} cluster rows")
    if cluster_ids.shape[0] > num_classes * clients:
        raise ProtocolError(f"the server sent {cluster_ids.shape[0]} cluster rows; at most C·N = "
                            f"{num_classes * clients} can exist")
    for name, rows in (("protos", protos), ("cluster_protos", clusters)):
        if rows.dim() != 2 or rows.shape[1] != width:
            raise ProtocolError(f"the server sent {name} of shape {tuple(rows.shape)}; rows are {width} wide")
    if cluster_ids.numel() and (cluster_ids.min() < 0 or cluster_ids.max() >= num_classes):
        raise ProtocolError(f"the server sent a cluster class id outside [0, {num_classes})")
    per_class = torch.bincount(cluster_ids, minlength=num_classes)
    if bool((per_class > clients).any()):
        raise ProtocolError(f"the server sent more than N = {clients} clusters for one class")
    has_unbiased = torch.zeros(num_classes, dtype=torch.bool)
    has_unbiased[class_ids] = True
    if not torch.equal(per_class > 0, has_unbiased):
        raise ProtocolError("the server's cluster prototypes and unbiased prototypes name different classes")


# ------------------------------------------------------------------------------------ the losses

@dataclass(frozen=True)
class PrototypeTargets:
    """What a client trains against, on its device: the cluster prototypes normalised (``units``
    [R, K]) with each row's class (``owners`` [R]), the unbiased table (``unbiased`` [C, K]) and
    which classes have prototypes (``available`` [C])."""

    units: torch.Tensor
    owners: torch.Tensor
    unbiased: torch.Tensor
    available: torch.Tensor

    @classmethod
    def from_download(cls, knowledge: Payload, num_classes: int, device: torch.device | str) -> PrototypeTargets:
        unbiased, available = dense_prototypes(knowledge, num_classes, device)
        return cls(F.normalize(knowledge["cluster_protos"].to(device), dim=1),
                   knowledge["cluster_class_ids"].to(device), unbiased, available)


def fpcl_terms(features: torch.Tensor, labels: torch.Tensor, targets: PrototypeTargets, tau: float) -> torch.Tensor:
    """FPCL per sample, [B]: −log of the share of e^{s(z, ĉ)/τ} that the sample's own class's cluster
    prototypes hold among all of them. 0 for a sample whose class has no prototype."""
    logits = F.normalize(features, dim=1) @ targets.units.t() / tau  # [B, R]
    known = targets.available[labels]
    # a class without prototypes would leave no positive (−inf, NaN gradients): count every row there,
    # and drop the sample's term below
    positive = (targets.owners.unsqueeze(0) == labels.unsqueeze(1)) | ~known.unsqueeze(1)
    terms = logits.logsumexp(dim=1) - logits.masked_fill(~positive, float("-inf")).logsumexp(dim=1)
    return torch.where(known, terms, torch.zeros_like(terms))


def upcr_terms(features: torch.Tensor, labels: torch.Tensor, targets: PrototypeTargets,
               reduction: UPCRReduction) -> torch.Tensor:
    """UPCR per sample, [B]: Σ_k (z_k − Ũ^y_k)² (or its mean over k); 0 where class y has none."""
    squared = (features - targets.unbiased[labels]).pow(2)
    terms = squared.sum(dim=1) if reduction == "sum" else squared.mean(dim=1)
    return torch.where(targets.available[labels], terms, torch.zeros_like(terms))


def fpl_regulariser(options: FPLOptions, batch: Batch, targets: PrototypeTargets) -> torch.Tensor:
    """(1/B) Σ_i [w_F·FPCL_i + w_U·UPCR_i] over the batch's real samples (``batch.weights``)."""
    terms = options.fpcl_weight * fpcl_terms(batch.features, batch.labels, targets, options.tau) + \
        options.upcr_weight * upcr_terms(batch.features, batch.labels, targets, options.upcr_reduction)
    if batch.weights is None:
        return terms.mean()
    return weighted_mean(terms, batch.weights)


# ------------------------------------------------------------------------------------ client and server

def last_epoch_only(clients: list[ClientState], train: TrainConfig,
                    on_batch: Callable[[Batch], None]) -> Callable[[Batch], None]:
    """``on_batch`` fed only the batches of each client's last local epoch. A client walks
    ⌈samples per epoch / B⌉ steps an epoch, one by one or in a batched group alike
    (``training.group_schedule``), so its step t is in the last epoch once t ≥ (E − 1)·steps; a
    batched step's rows of clients still in earlier epochs get weight 0."""
    skipped = torch.tensor([(train.local_epochs - 1) * -(-samples_per_epoch(c.train_y.shape[0], train)
                                                        // train.batch_size) for c in clients])
    step = 0

    def seen(batch: Batch) -> None:
        nonlocal step
        late = (skipped <= step).to(batch.features.device)
        step += 1
        if batch.weights is None:  # one client's own loop
            if bool(late[0]):
                on_batch(batch)
            return
        on_batch(dataclasses.replace(batch, weights=batch.weights * late.unsqueeze(1).to(batch.weights.dtype)))

    return seen


class FPLClient(PrototypeClient):
    """CE + FPCL + UPCR against the downloaded prototypes; uploads P_i^c (when ``proto_from`` says,
    from the last local epoch's batches by default, as the reference does); classifies with its
    own head."""

    capturable_step = False  # a loss of its own, not checked for host syncs

    def prototypes_around(self, clients: list[ClientState],
                          train: Callable[[Callable[[Batch], None] | None], list[tuple[float, int]]]
                          ) -> list[tuple[torch.Tensor, torch.Tensor, float, int]]:
        if self.options.proto_from != "during_training" or self.options.proto_epochs == "all":
            return super().prototypes_around(clients, train)
        return super().prototypes_around(clients, lambda on_batch: train(
            None if on_batch is None else last_epoch_only(clients, self.context.train, on_batch)))

    def loss_function(self, knowledge: Payload, device: torch.device) -> Callable[[Batch], torch.Tensor]:
        check_download(knowledge, self.context)
        if knowledge["class_ids"].numel() == 0:
            return batch_cross_entropy
        targets = PrototypeTargets.from_download(knowledge, self.context.num_classes, device)

        def loss_fn(batch: Batch) -> torch.Tensor:
            return batch_cross_entropy(batch) + fpl_regulariser(self.options, batch, targets)

        return loss_fn

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        return logits.argmax(dim=1)


class FPLServer(ServerAlgorithm):
    """Per class, FINCH on the round's uploads of that class (client-id order) → the cluster
    prototypes and their plain mean, the unbiased prototype. Classes nobody uploaded this round
    are absent; nothing else is remembered across rounds."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return fpl_download_fields(context)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        width = context.feature_dim
        self.class_ids = torch.empty(0, dtype=torch.int64)
        self.protos = torch.empty(0, width)
        self.cluster_class_ids = torch.empty(0, dtype=torch.int64)
        self.cluster_protos = torch.empty(0, width)

    def download(self) -> Payload:
        return {"class_ids": self.class_ids, "protos": self.protos,
                "cluster_class_ids": self.cluster_class_ids, "cluster_protos": self.cluster_protos}

    def theory_download_floats(self) -> int:
        """K·(clusters + classes): every cluster prototype and every unbiased prototype sent."""
        return self.context.feature_dim * (self.cluster_class_ids.numel() + self.class_ids.numel())

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload["protos"], self.context.num_classes)

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        previous = self.download()
        per_class: dict[int, list[torch.Tensor]] = {}
        for client_id in sorted(uploads):  # client-id order: the same clusters on any world size
            upload = uploads[client_id]
            for class_id, proto in zip(upload["class_ids"].tolist(), upload["protos"], strict=True):
                per_class.setdefault(class_id, []).append(proto.double().cpu())
        classes = sorted(per_class)
        centres = [class_clusters(torch.stack(per_class[c]), self.options.finch_partition) for c in classes]
        self.class_ids = torch.tensor(classes, dtype=torch.int64)
        self.protos = torch.stack([rows.mean(dim=0) for rows in centres]).float()
        self.cluster_class_ids = torch.cat([torch.full((rows.shape[0],), c, dtype=torch.int64)
                                            for c, rows in zip(classes, centres, strict=True)])
        self.cluster_protos = torch.cat(centres).float()
        counts = [rows.shape[0] for rows in centres]
        return {"global_classes": float(len(classes)), "clusters": float(sum(counts)),
                "clusters_per_class_max": float(max(counts)),
                **global_prototype_diagnostics(uploads, self.context.num_classes,
                                               {"class_ids": self.class_ids, "protos": self.protos}, previous)}

    def state_dict(self) -> dict[str, Any]:
        return self.download()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.class_ids, self.protos = state["class_ids"], state["protos"]
        self.cluster_class_ids, self.cluster_protos = state["cluster_class_ids"], state["cluster_protos"]


register_algorithm("fpl", server=FPLServer, client=FPLClient, options=FPLOptions,
                   summary="FINCH cluster prototypes and their mean, the unbiased prototype; clients train "
                           "CE + cluster-prototype InfoNCE + distance to the unbiased prototype "
                           "(Huang et al. 2023)")
