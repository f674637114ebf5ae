"""FedPAC (Xu, Tong and Huang, ICLR 2023), heads shared as HtFLlib shares them (docs/algorithms.md,
"FedPAC").

Each round a participant:

1. installs its personalised head from the download (if the server has made one for it);
2. measures its feature statistics on the model it starts from: per class the count n_k and mean
   μ_k, and V = Σ_k p_k·E[‖z‖² | k] − p_k²·‖μ_k‖² (p_k = n_k / n), the variance of z placed in
   its class's block;
3. trains the head alone (feature extractor frozen) with CE for ``head_epochs``;
4. trains the feature extractor (head frozen) for ``train.local_epochs`` with
   CE + λ·MSE(f(x), c_y), c_y the global prototype of y (its own step-2 mean where the server has
   none); CE alone before any global prototype exists;
5. uploads its post-update prototypes, the step-2 statistics and its head.

The server averages the prototypes per class, weighted by the class counts, and, for each
uploader i, finds the combination of the round's heads that minimises the estimated
bias-variance of client i's classifier (a quadratic over the simplex; ``simplex_quadratic_min``
solves it exactly, where the reference calls cvxpy). Every client's latest combined head goes
down, so a client that missed rounds still finds its own.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.blocks.model_part import HEAD
from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    check_class_counts,
    check_class_rows,
    class_prototypes,
    dense_class_table,
)
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.optimizers import build_optimizer, current_learning_rate
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.errors import ProtocolError
from htfl_dist.payload import Field, Payload, PayloadSpec

ProtoAverage = Literal["count_weighted", "uniform"]


@dataclass
class FedPACOptions:
    """Defaults: the official code (JianXu95/FedPAC@5770f4f); docs/algorithms.md lists each source."""

    lam: float = bounded(1.0, at_least=0)
    """λ of the alignment term λ·MSE(f(x), c_y) (``options.py --lam``)."""
    head_epochs: int = bounded(1, at_least=1)
    """Epochs of the head-only stage (``epoch_classifier = 1`` in ``local_training``)."""
    head_lr: float | None = bounded(0.1, above=0, optional=True, note="or null: the client's learning rate")
    """Learning rate of the head-only stage (``lr_g = 0.1``); null: the client's rate (PFLlib)."""
    proto_avg: ProtoAverage = "count_weighted"
    """Global prototype c_k = Σ_i n_ik·μ_ik / Σ_i n_ik (``protos_aggregation``); uniform: PFLlib's plain mean."""
    weight_floor: float = bounded(1e-3, at_least=0, below=1)
    """Combination weights at or below this are dropped and the rest renormalised (``eps = 1e-3``)."""


# --------------------------------------------------------------------------- the maths


def alignment_loss(features: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """MSE(f(x), c_y): the mean over the batch and the K dimensions of (f(x) − c_y)², the
    reference's ``nn.MSELoss`` (the paper's ‖f(x) − c_y‖² divided by K). ``targets`` [C, K]."""
    return F.mse_loss(features, targets[labels])


def variance_of_statistics(counts: torch.Tensor, means: torch.Tensor, square_norms: torch.Tensor) -> float:
    """V = Σ_k p_k·E[‖z‖² | k] − p_k²·‖μ_k‖², p_k = n_k / Σn: the variance of z ⊗ e_y (z in its
    class's block), whose mean is the stacked p_k·μ_k (the bias term's h). ``square_norms`` [m]
    are the E[‖z‖² | k]; clamped at 0 against rounding."""
    share = counts.double() / counts.sum()
    value = (share * square_norms.double()).sum() - (share.square() * means.double().square().sum(dim=1)).sum()
    return max(float(value), 0.0)


def simplex_quadratic_min(gram: torch.Tensor, tolerance: float = 1e-12) -> torch.Tensor:
    """argmin αᵀGα over α ≥ 0, Σα = 1, for a positive semi-definite G [n, n] (float64).

    G is the Gram matrix of points p_j, so this is the point of their convex hull nearest the
    origin, found by Wolfe's exact min-norm-point algorithm (finitely many steps, each an affine
    solve; no tolerance-driven descent). All-zero G: every α is optimal; the uniform one."""
    n = gram.shape[0]
    scale = float(gram.diagonal().max())
    if scale <= 0:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    corral, weights = [int(gram.diagonal().argmin())], torch.ones(1, dtype=torch.float64)
    for _ in range(10 * n + 10):  # Wolfe's method ends; this bounds a rounding-induced cycle
        products = gram[:, corral] @ weights  # x·p_j for every j, x = Σ weights·p_corral
        entering = int(products.argmin())
        if entering in corral or float(weights @ products[corral] - products[entering]) <= tolerance * scale:
            break
        corral, weights = _minor_cycle(gram, [*corral, entering], torch.cat([weights, weights.new_zeros(1)]))
    alpha = torch.zeros(n, dtype=torch.float64)
    alpha[corral] = weights
    return alpha


def _minor_cycle(gram: torch.Tensor, corral: list[int], weights: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Wolfe's minor cycle: move towards the affine minimiser of the corral, dropping points whose
    weight reaches 0, until the minimiser lies inside the hull of what is left."""
    while True:
        size = len(corral)
        system = torch.ones(size + 1, size + 1, dtype=torch.float64)
        system[:size, :size] = gram[corral][:, corral]
        system[size, size] = 0.0
        target = torch.zeros(size + 1, dtype=torch.float64)
        target[size] = 1.0
        affine = torch.linalg.solve(system, target)[:size]
        if bool((affine > 0).all()):
            return corral, affine
        leaving = affine <= 0
        step = float((weights[leaving] / (weights[leaving] - affine[leaving])).min())
        weights = weights + step * (affine - weights)
        kept = weights > 1e-15
        corral = [index for index, keep in zip(corral, kept.tolist(), strict=True) if keep]
        weights = weights[kept] / weights[kept].sum()


def combination_weights(stacked: torch.Tensor, variances: torch.Tensor, floor: float) -> torch.Tensor:
    """Row i: client i's weights over the n clients (``stacked`` [n, C, K], each h_j = (p_jk·μ_jk)_k;
    ``variances`` [n], V_j / n_j), argmin_α Σ_j α_j²·v_j + ‖Σ_j α_j·(h_i − h_j)‖² on the simplex;
    weights ≤ ``floor`` dropped and the rest renormalised."""
    flat = stacked.double().flatten(1)
    rows = []
    for i in range(flat.shape[0]):
        bias = flat[i] - flat
        alpha = simplex_quadratic_min(bias @ bias.t() + torch.diag(variances.double()))
        alpha = torch.where(alpha > floor, alpha, torch.zeros_like(alpha))
        rows.append(alpha / alpha.sum())
    return torch.stack(rows)


def bias_rows(upload: Payload, num_classes: int) -> torch.Tensor:
    """h_j [C, K]: p_jk·μ_jk for the classes client j holds, 0 elsewhere (float64)."""
    counts = upload["counts"].double()
    table = torch.zeros(num_classes, upload["means"].shape[1], dtype=torch.float64)
    table[upload["class_ids"]] = upload["means"].double() * (counts / counts.sum()).unsqueeze(1)
    return table


# --------------------------------------------------------------------------- the client


@torch.no_grad()
def feature_statistics(client: ClientState, num_classes: int, batch_size: int = 512
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(class ids [m], counts [m], means μ_k [m, K], E[‖z‖² | k] [m]) of f(x) over the client's
    training split, in eval mode."""
    model, was_training = client.model, client.model.training
    model.eval()
    means = squares = None
    for start in range(0, client.train_y.shape[0], batch_size):
        features = model.features(client.train_x[start : start + batch_size]).double()
        labels = client.train_y[start : start + batch_size]
        if means is None or squares is None:
            means = ClassMeans(num_classes, features.shape[1], client.device, torch.float64)
            squares = ClassMeans(num_classes, 1, client.device, torch.float64)
        means.add(features, labels)
        squares.add(features.square().sum(dim=1, keepdim=True), labels)
    model.train(was_training)
    assert means is not None and squares is not None, "a client has training data"
    present = torch.nonzero(means.present()).flatten()
    return (present.cpu(), means.weights[present].long().cpu(), means.dense()[present].cpu(),
            squares.dense()[present, 0].cpu())


class FedPACClient(ClientAlgorithm):
    """Two-stage local training (head, then feature extractor with feature alignment); uploads
    prototypes, statistics and the head; evaluates with its personalised head."""

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        HEAD.check(context, "FedPAC")

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        classes, width = context.num_classes, context.feature_dim
        return (Field("class_ids", torch.int64, max_rows=classes), Field("counts", torch.int64, max_rows=classes),
                Field("protos", torch.float32, (width,), classes), Field("means", torch.float32, (width,), classes),
                Field("variance", torch.float32, max_rows=1), HEAD.field(context))

    def install(self, client: ClientState, knowledge: Payload) -> None:
        """The server's combined head for this client, if it has made one (a copy: the row is shared)."""
        mine = torch.nonzero(knowledge["head_ids"] == client.client_id).flatten()
        if mine.numel():
            parameters.load_parameter_row(client.model.head, knowledge["heads"][int(mine[0])].to(client.device))

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        self.install(client, knowledge)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        self.install(client, knowledge)
        class_ids, counts, means, squares = feature_statistics(client, self.context.num_classes)
        head_loss, head_seen = self.train_head(client, generator)
        targets = self.alignment_targets(knowledge, class_ids, means, client.device)
        body_loss, body_seen = self.train_extractor(client, targets, generator)
        proto_ids, protos = class_prototypes(client, self.context.num_classes)
        assert torch.equal(proto_ids, class_ids), "the classes a client holds do not change"
        upload = {"class_ids": class_ids, "counts": counts, "protos": protos.float(), "means": means.float(),
                  "variance": torch.tensor([variance_of_statistics(counts, means, squares)], dtype=torch.float32),
                  HEAD.name: parameters.parameter_row(client.model.head)}
        return TrainResult(upload, head_loss + body_loss, head_seen + body_seen)

    def train_head(self, client: ClientState, generator: torch.Generator) -> tuple[float, int]:
        """``head_epochs`` of CE on the head alone, the extractor frozen, with a fresh optimizer
        (``train.optimizer`` at ``head_lr``), as the reference builds one each round."""
        options = self.options
        head = client.model.head
        rate = options.head_lr if options.head_lr is not None else current_learning_rate(client)
        optimizer = build_optimizer(head.parameters(), self.context.train, lr=rate)
        context = dataclasses.replace(self.context, train=dataclasses.replace(self.context.train,
                                                                              local_epochs=options.head_epochs))
        with frozen(client.model.feature_extractor):
            return run_local_training(client, context, lambda batch: F.cross_entropy(batch.logits, batch.labels),
                                      generator, optimizers=(optimizer,))

    def train_extractor(self, client: ClientState, targets: torch.Tensor | None,
                        generator: torch.Generator) -> tuple[float, int]:
        """``train.local_epochs`` of CE + λ·MSE(f(x), c_y) with the head frozen (the client's own
        optimizer; the frozen head gets no gradient, so it does not step)."""
        lam = self.options.lam

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = F.cross_entropy(batch.logits, batch.labels)
            if targets is not None:
                loss = loss + lam * alignment_loss(batch.features, batch.labels, targets)
            return loss

        with frozen(client.model.head):
            return run_local_training(client, self.context, loss_fn, generator)

    def alignment_targets(self, knowledge: Payload, class_ids: torch.Tensor, means: torch.Tensor,
                          device: torch.device) -> torch.Tensor | None:
        """c_y per class [C, K]: the global prototype, or the client's own pre-update mean where the
        server has none (the reference's ``local_protos1``); None before any global prototype."""
        if knowledge["class_ids"].numel() == 0:
            return None
        table, available = dense_class_table(knowledge, "protos", self.context.num_classes, device)
        own = torch.zeros_like(table)
        own[class_ids.to(device)] = means.to(device, table.dtype)
        return torch.where(available.unsqueeze(1), table, own)

    def theory_upload_floats(self, client: ClientState) -> int:
        """2·K·|C_i| (prototypes, statistic means) + 1 (V_i) + the head's parameters."""
        held = int(client.classes.numel())
        return 2 * self.context.feature_dim * held + 1 + parameters.parameter_count(client.model.head)


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters left out of autograd inside the block (no gradient, so no step
    and no weight decay), restored after."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


# --------------------------------------------------------------------------- the server


class FedPACServer(ServerAlgorithm):
    """Count-weighted global prototypes of the round; per uploader a QP-weighted combination of
    the round's heads, kept per client across rounds; both go down."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        classes, clients = context.num_classes, context.num_clients
        return (Field("class_ids", torch.int64, max_rows=classes),
                Field("protos", torch.float32, (context.feature_dim,), classes),
                Field("head_ids", torch.int64, max_rows=clients),
                Field("heads", torch.float32, (HEAD.floats(context),), clients))

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.class_ids = torch.empty(0, dtype=torch.int64)
        self.protos = torch.empty(0, context.feature_dim)
        self.heads: dict[int, torch.Tensor] = {}

    def download(self) -> Payload:
        owners = sorted(self.heads)
        heads = torch.stack([self.heads[i] for i in owners]) if owners else torch.empty(0, HEAD.floats(self.context))
        return {"class_ids": self.class_ids, "protos": self.protos,
                "head_ids": torch.tensor(owners, dtype=torch.int64), "heads": heads}

    def theory_download_floats(self) -> int:
        """K·C global prototypes + the client's own combined head (the paper sends each its own)."""
        return self.context.feature_dim * self.context.num_classes + HEAD.floats(self.context)

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        class_ids = upload["class_ids"]
        check_class_rows(client_id, class_ids, upload["protos"], self.context.num_classes)
        check_class_rows(client_id, class_ids, upload["means"], self.context.num_classes)
        check_class_counts(client_id, class_ids, upload["counts"])
        if upload["variance"].shape[0] != 1 or float(upload["variance"][0]) < 0:
            raise ProtocolError(f"client {client_id} sent variance={upload['variance'].tolist()}, "
                                f"expected one value >= 0")
        if upload[HEAD.name].shape[0] != 1:
            raise ProtocolError(f"client {client_id} sent {upload[HEAD.name].shape[0]} head rows, expected 1")

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        order = sorted(uploads)
        self.aggregate_prototypes([uploads[i] for i in order])
        weights = self.head_weights([uploads[i] for i in order])
        heads = torch.cat([uploads[i][HEAD.name].double() for i in order])
        for row, client_id in enumerate(order):
            self.heads[client_id] = (weights[row] @ heads).float()
        return {"global_classes": float(self.class_ids.numel()),
                "head_self_weight": float(weights.diagonal().mean()),
                "head_partners": float((weights > 0).sum(dim=1).double().mean())}

    def aggregate_prototypes(self, uploads: list[Payload]) -> None:
        """c_k = Σ_i n_ik·μ_ik / Σ_i n_ik over this round's uploaders of class k (``count_weighted``)."""
        means = ClassMeans(self.context.num_classes, self.context.feature_dim, dtype=torch.float64)
        for upload in uploads:
            counts = upload["counts"] if self.options.proto_avg == "count_weighted" else None
            means.add(upload["protos"], upload["class_ids"], counts)
        self.class_ids, rows = means.rows()
        self.protos = rows.float()

    def head_weights(self, uploads: list[Payload]) -> torch.Tensor:
        """[n, n] combination weights of the round's uploaders (client-id order)."""
        stacked = torch.stack([bias_rows(upload, self.context.num_classes) for upload in uploads])
        variances = torch.tensor([float(u["variance"][0]) / float(u["counts"].sum()) for u in uploads],
                                 dtype=torch.float64)
        return combination_weights(stacked, variances, self.options.weight_floor)

    def state_dict(self) -> dict[str, Any]:
        return self.download()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.class_ids, self.protos = state["class_ids"], state["protos"]
        self.heads = {int(i): row for i, row in zip(state["head_ids"].tolist(), state["heads"], strict=True)}


register_algorithm("fedpac", server=FedPACServer, client=FedPACClient, options=FedPACOptions,
                   summary="feature alignment to global prototypes, QP-weighted combination of client heads "
                           "(Xu et al. 2023)", shares_parameters=True)
