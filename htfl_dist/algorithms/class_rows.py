"""Class-indexed rows: the knowledge most HtFL methods exchange.

A client computes one row per class it holds (a prototype = mean feature, FedProto/FedTGP/FedGH;
or a mean logit vector, FedDistill); only those classes travel, as (``class_ids``, rows). The
server averages them per class (``ClassMeanServer``) or trains on them; clients gather the
downloaded table per sample. One set of helpers for every such method, whatever the row is
(features or logits) and whatever the payload key is.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from htfl_dist.algorithms.interface import AlgorithmContext, ClientState, ServerAlgorithm
from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec

RowSource = Literal["features", "logits"]


def class_row_fields(key: str, width: int, num_classes: int | None = None) -> PayloadSpec:
    """(class_ids int64 [m], key float32 [m, width]): only the classes the sender has travel, so
    m <= C (``num_classes``, which bounds what rank 0 accepts)."""
    return (Field("class_ids", torch.int64, max_rows=num_classes), Field(key, torch.float32, (width,), num_classes))


class ClassMeans:
    """Per-class (optionally weighted) means of rows, accumulated batch by batch.

    The one implementation behind client prototypes and logit means (after or during training),
    the class-mean servers and FedTGP's cluster centres. Sums are dense [C, D]: adding a batch has
    no data-dependent shapes, so it never waits for the GPU."""

    def __init__(self, num_classes: int, width: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.sums = torch.zeros(num_classes, width, device=device, dtype=dtype)
        self.weights = torch.zeros(num_classes, device=device, dtype=dtype)

    def add(self, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        rows = rows.to(self.sums.dtype)
        if weights is None:
            self.sums.index_add_(0, labels, rows)
            self.weights += torch.bincount(labels, minlength=self.weights.shape[0]).to(self.weights.dtype)
        else:
            weights = weights.to(self.sums.dtype)
            self.sums.index_add_(0, labels, rows * weights.unsqueeze(1))
            self.weights.index_add_(0, labels, weights)

    def present(self) -> torch.Tensor:
        """[C] bool: classes that received any weight."""
        return self.weights > 0

    def dense(self) -> torch.Tensor:
        """[C, D] means; rows of absent classes are 0."""
        denominator = torch.where(self.present(), self.weights, torch.ones_like(self.weights))
        return self.sums / denominator.unsqueeze(1)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(class ids int64 [m], means [m, D]) of the m present classes, on the CPU."""
        return _present_means(self.sums, self.weights)


def batch_class_means(rows: torch.Tensor, labels: torch.Tensor, num_classes: int, *,
                      row_weights: torch.Tensor | None = None, kept_classes: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's per-class means inside a loss: (means [C, D], differentiable, 0 for absent
    classes; the weight each class received [C]). ``row_weights`` weigh the rows (``Batch.weights``:
    0 for padding), ``kept_classes`` ([C] bool) leaves classes out. A one-hot product rather than
    ``ClassMeans``' in-place accumulation: out of place and without data-dependent shapes, so it
    needs no host sync per training step and runs under ``vmap`` (batched clients, DP-SGD's
    per-sample losses)."""
    onehot = labels.unsqueeze(1) == torch.arange(num_classes, device=labels.device)
    if kept_classes is not None:
        onehot = onehot & kept_classes
    onehot = onehot.to(rows.dtype)
    if row_weights is not None:
        onehot = onehot * row_weights.unsqueeze(1)
    counts = onehot.sum(dim=0)
    return (onehot.t() @ rows) / counts.clamp(min=1).unsqueeze(1), counts


def _present_means(sums: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    present = torch.nonzero(weights > 0).flatten()
    return present.cpu(), (sums[present] / weights[present].unsqueeze(1)).cpu()


class GroupClassMeans:
    """``ClassMeans`` of G clients in one [G·C, D] table (client g's class c is row g·C + c), so
    a batched training step (``training.run_batched_training``) adds every client's rows at once.
    Per client the sums are what its own ``ClassMeans`` would hold."""

    def __init__(self, groups: int, num_classes: int, width: int, device: torch.device | str = "cpu") -> None:
        self.groups, self.num_classes = groups, num_classes
        self.means = ClassMeans(groups * num_classes, width, device)

    def add(self, rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """One client's rows [B, D] (a group of one, ``weights`` None), or a batched step's
        [G, B, D] with labels and ``weights`` [G, B] (0 for padding rows)."""
        if weights is None:
            self.means.add(rows, labels)
            return
        offsets = torch.arange(self.groups, device=labels.device).unsqueeze(1) * self.num_classes
        self.means.add(rows.flatten(0, 1), (labels + offsets).flatten(), weights.flatten())

    def rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per client, ``ClassMeans.rows``: (class ids [m], means [m, D]) on the CPU."""
        sums = self.means.sums.view(self.groups, self.num_classes, -1)
        weights = self.means.weights.view(self.groups, self.num_classes)
        return [_present_means(sums[g], weights[g]) for g in range(self.groups)]


@torch.no_grad()
def class_means(client: ClientState, num_classes: int, source: RowSource = "features",
                batch_size: int = 512, unit_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of f_i(x) (``features``) or of h_i(f_i(x)) (``logits``) per class over the client's
    training samples, in eval mode; ``unit_rows`` L2-normalises every row before it is averaged
    (FedKTL's prototypes live on the unit sphere of its ETF classifier).

    Returns (class ids int64 [m], rows float32 [m, D]) for the m classes it holds.

    For a private client (``client.private``) this is the release of every class-row upload:
    each row is clipped to ``privacy.feature_clip`` before it is averaged, and the means leave
    through ``client.private.release_class_means`` (classes with too few samples dropped,
    Gaussian noise, the ledger charged; nothing once the budget is spent)."""
    private = client.private
    model = client.model
    was_training = model.training
    model.eval()
    means: ClassMeans | None = None
    for start in range(0, client.train_y.shape[0], batch_size):
        x = client.train_x[start : start + batch_size]
        rows = model.features(x) if source == "features" else model(x)
        if unit_rows:
            rows = torch.nn.functional.normalize(rows, dim=1)
        if private is not None:
            rows = private.clip_rows(rows)
        if means is None:
            means = ClassMeans(num_classes, rows.shape[1], client.device)
        means.add(rows, client.train_y[start : start + batch_size])
    model.train(was_training)
    assert means is not None, "a client has training data (the partition guarantees it)"
    if private is not None:
        return private.release_class_means(means.sums, means.weights)
    return means.rows()


def class_prototypes(client: ClientState, num_classes: int, batch_size: int = 512
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """P_i^c = mean of f_i(x) over the client's training samples of class c (eval mode)."""
    return class_means(client, num_classes, "features", batch_size)


def dense_class_table(knowledge: Payload, key: str, num_classes: int, device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [C, D], available mask [C]) from downloaded (class_ids, key) rows."""
    class_ids, rows = knowledge["class_ids"], knowledge[key]
    table = torch.zeros(num_classes, rows.shape[1], device=device)
    available = torch.zeros(num_classes, dtype=torch.bool, device=device)
    table[class_ids.to(device)] = rows.to(device)
    available[class_ids.to(device)] = True
    return table, available


def dense_prototypes(knowledge: Payload, num_classes: int, device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [C, K], available mask [C]) from the downloaded (class_ids, protos) rows."""
    return dense_class_table(knowledge, "protos", num_classes, device)


def check_class_rows(sender: int | str, class_ids: torch.Tensor, rows: torch.Tensor, num_classes: int) -> None:
    """Semantic checks on class-indexed rows (the runtime already checked dtype, shape and
    finiteness): an upload of client ``sender`` (its id), or a download (``sender`` names who,
    "the server")."""
    who = f"client {sender}" if isinstance(sender, int) else sender
    if class_ids.shape[0] != rows.shape[0]:
        raise ProtocolError(f"{who} sent {class_ids.shape[0]} class ids for {rows.shape[0]} rows")
    if class_ids.numel() and (class_ids.min() < 0 or class_ids.max() >= num_classes):
        raise ProtocolError(f"{who} sent a class id outside [0, {num_classes})")
    if torch.unique(class_ids).numel() != class_ids.numel():
        raise ProtocolError(f"{who} sent a class id twice")


def check_class_counts(client_id: int, class_ids: torch.Tensor, counts: torch.Tensor) -> None:
    """An upload's per-class sample counts (for count-weighted means): one per class row, each
    positive, so no class's weight is zero, negative or unmatched."""
    if counts.shape[0] != class_ids.shape[0] or bool((counts <= 0).any()):
        raise ProtocolError(f"client {client_id} sent invalid class counts")


def euclidean_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_i − b_j‖₂, computed directly: torch.cdist's default switches to a less precise
    matmul form above 25 rows (e.g. C = 100), which blurs close prototypes."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


class ClassMeanServer(ServerAlgorithm):
    """Ḡ^c = mean over the uploaders of class c of their row for c; classes nobody uploaded this
    round are absent. Nothing is remembered across rounds except the last table.

    A variant sets ``key`` and ``row_width`` and, if it needs them, overrides ``row_weights``
    (weighted means) or ``diagnostics``. FedProto (prototypes) and FedDistill (logits) are two
    such variants."""

    accepts_late_uploads = True  # a late upload is one more row in a class's mean

    key: ClassVar[str] = "rows"

    @classmethod
    def row_width(cls, context: AlgorithmContext) -> int:
        raise NotImplementedError

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields(cls.key, cls.row_width(context), context.num_classes)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.class_ids = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, self.row_width(context))

    def download(self) -> Payload:
        return {"class_ids": self.class_ids, self.key: self.rows}

    def theory_download_floats(self) -> int:
        """D·C: the papers count a row for every class."""
        return self.row_width(self.context) * self.context.num_classes

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_class_rows(client_id, upload["class_ids"], upload[self.key], self.context.num_classes)

    @classmethod
    def row_weights(cls, context: AlgorithmContext, upload: Payload) -> torch.Tensor | None:
        """Per-row weights of an upload (None: every uploader of a class weighs the same); a
        function of the upload and the options alone, so a client's rank can weigh its own
        contribution (``contribution``)."""
        return None

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        means = ClassMeans(self.context.num_classes, self.row_width(self.context), dtype=torch.float64)
        for client_id in sorted(uploads):  # fixed order: the float64 sums do not depend on ranks
            upload = uploads[client_id]
            means.add(upload[self.key], upload["class_ids"], self.row_weights(self.context, upload))
        previous = self.download()
        self.class_ids, rows = means.rows()
        self.rows = rows.float()
        return {"global_classes": float(self.class_ids.numel()), **self.diagnostics(uploads, previous)}

    def diagnostics(self, uploads: dict[int, Payload], previous: Payload) -> dict[str, Any]:
        """Extra numbers for the metrics row, given the uploads and the table before this update."""
        return {}

    @classmethod
    def summed_fields(cls, context: AlgorithmContext) -> dict[str, tuple[int, ...]] | None:
        """Σ_i w_i·row_i^c per class [C, D] and Σ_i w_i per class [C]: each mean is their ratio."""
        return {"row_sums": (context.num_classes, cls.row_width(context)), "weights": (context.num_classes,)}

    @classmethod
    def contribution(cls, context: AlgorithmContext, upload: Payload) -> dict[str, torch.Tensor]:
        ids, rows = upload["class_ids"].long().cpu(), upload[cls.key].double().cpu()
        weights = cls.row_weights(context, upload)
        weights = torch.ones(ids.numel(), dtype=torch.float64) if weights is None else weights.double().cpu()
        row_sums = torch.zeros(context.num_classes, cls.row_width(context), dtype=torch.float64)
        totals = torch.zeros(context.num_classes, dtype=torch.float64)
        row_sums.index_add_(0, ids, rows * weights[:, None])
        totals.index_add_(0, ids, weights)
        return {"row_sums": row_sums, "weights": totals}

    def update_from_sums(self, sums: dict[str, torch.Tensor], uploaders: int, round_index: int,
                         generator: torch.Generator) -> dict[str, Any]:
        weights = sums["weights"].double()
        present = weights > 0
        self.class_ids = torch.nonzero(present).flatten()
        self.rows = (sums["row_sums"].double()[present] / weights[present, None]).float()
        return {"global_classes": float(self.class_ids.numel())}

    def state_dict(self) -> dict[str, Any]:
        return {"class_ids": self.class_ids, self.key: self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.class_ids, self.rows = state["class_ids"], state[self.key]


@torch.no_grad()
def global_prototype_diagnostics(uploads: dict[int, Payload], num_classes: int, current: Payload,
                                 previous: Payload) -> dict[str, float]:
    """How the global prototypes (a download payload: class_ids, protos) sit against what clients
    uploaded, and how far they moved since the previous round's download.

    Nearest-global-prototype inference works only if client features fall in their own class's
    cell, and clients train towards last round's prototypes, so these explain the accuracy:
    ``upload_to_global``: mean ‖P_i^c − P̂^c‖ over the round's uploads; ``upload_nearest_own``:
    share of uploads whose nearest global prototype is their own class's; ``proto_drift``: mean
    ‖P̂_t^c − P̂_{t−1}^c‖ over the classes present in both rounds."""
    protos, present = dense_prototypes(current, num_classes)
    if not bool(present.any()):
        return {}
    result: dict[str, float] = {}
    rows = torch.cat([payload["protos"].float().cpu() for payload in uploads.values()])
    labels = torch.cat([payload["class_ids"].cpu() for payload in uploads.values()])
    known = present[labels]
    if bool(known.any()):
        distances = euclidean_distances(rows[known], protos)
        distances[:, ~present] = float("inf")
        own = distances.gather(1, labels[known].unsqueeze(1)).squeeze(1)
        result["upload_to_global"] = float(own.mean())
        result["upload_nearest_own"] = float((distances.argmin(dim=1) == labels[known]).float().mean())
    old, old_present = dense_prototypes(previous, num_classes)
    both = present & old_present
    if bool(both.any()):
        result["proto_drift"] = float((protos[both] - old[both]).norm(dim=1).mean())
    return result
