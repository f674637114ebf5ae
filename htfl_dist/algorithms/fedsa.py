"""FedSA (Zhou et al., AAAI 2025): prototype-based FL with semantic anchors (docs/algorithms.md,
"FedSA").

The server holds one *semantic anchor* per class, Ā = h_ψ(A): a seeded random table A ~ N(0, I)
sent once through a fixed random projection h_ψ = (Linear → BatchNorm → ReLU) × 2, with the
batch statistics taken over the C anchors. Clients train

    L_i = CE(h_i(f_i(x)), y) + λ1·L_R + λ2·L_MCL + λ3·L_CC                         (Eq. 9)

    L_R   = Σ_{c in the batch} ‖P^c − Ā^c‖₂ (Eq. 5, P^c the batch's class mean), or the
            per-sample MSE(f(x), Ā^y) of the reference code
    L_MCL = CE over −(‖p − Ā^k‖₂ + d_i*·[k = c]), p a class mean (Eq. 7) or each sample (code),
            d_i* = max(d_global, d_i): the anchors' margin and the client's own prototypes'
            margin (Eq. 6), held for the round
    L_CC  = CE(h_i(Ā), [0 .. C−1]): the head classifies every anchor (Eq. 8)

and upload their prototypes for the classes they hold. The server averages them per class
(P̄, FedProto's server) and moves the anchors of the classes present by EMA,
Ā^c ← α·Ā^c + (1 − α)·P̄^c with α = 0.9999 (Eq. 10). Every client downloads Ā (C·K floats),
plus P̄ and its presence mask with the reference code's inference rule, the nearest P̄ of the
last round (``inference=proto_last``, default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms.class_rows import (
    batch_class_means,
    dense_prototypes,
    euclidean_distances,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.fedproto import FedProtoClient, FedProtoServer
from htfl_dist.algorithms.fedtgp import class_margins, margin_contrastive_loss
from htfl_dist.algorithms.interface import AlgorithmContext, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import Batch
from htfl_dist.config import bounded
from htfl_dist.payload import Field, Payload, PayloadSpec
from htfl_dist.seeding import derive_seed, torch_generator

RegDistance = Literal["euclid", "mse"]
ContrastOn = Literal["prototypes", "samples"]
MarginRule = Literal["pairwise", "nearest"]
ProtoFrom = Literal["post_update", "pre_update", "during_training"]
Inference = Literal["proto_last", "anchor", "head"]

DEFAULT_REG_WEIGHT = {"euclid": 0.1, "mse": 10.0}
MEMORY = "fedsa_protos"


@dataclass
class FedSAOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes the reference code's value (lokinko/FedSA, built on
    HtFLlib): reg_distance=mse (so λ1 = 10), contrast_on=samples, margin_rule=nearest,
    proto_from=during_training, weighted=false."""
    reg_distance: RegDistance | None = None
    """L_R: euclid = Σ over the batch's classes of ‖P^c − Ā^c‖₂ (Eq. 5; default); mse =
    MSE(f(x), Ā^y) per sample, over B·K (code)."""
    reg_weight: float | None = bounded(None, at_least=0, optional=True)
    """λ1; default 0.1 with reg_distance=euclid (paper), 10 with mse (code's scripts)."""
    mcl_weight: float = bounded(1.0, at_least=0)
    """λ2 (paper: 1 under model heterogeneity, Tables 2-5; 0.01 for the homogeneous Table 1; code 1)."""
    cc_weight: float = bounded(1.0, at_least=0)
    """λ3 (paper and code: 1)."""
    contrast_on: ContrastOn | None = None
    """L_MCL on prototypes = the batch's class means, averaged over its classes (Eq. 7; default),
    or on samples = every feature (code)."""
    margin_rule: MarginRule | None = None
    """Margin of a set of vectors (anchors: d_global; a client's prototypes: d_i): pairwise = mean
    distance over all ordered pairs (Eq. 6, with N(N−1) pairs; default); nearest = mean distance
    to the nearest other vector (code)."""
    proto_from: ProtoFrom | None = None
    """Uploaded prototypes (and the client's local margin at its next participation):
    post_update = class means of f_i(x) after training, eval mode (Eq. 2; default);
    pre_update = before training; during_training = the features seen in training (code)."""
    weighted: bool | None = None
    """P̄^c weighted by class counts (the paper's "weighted-averaging", Eq. 3 without its extra
    1/|N_c|; counts travel; default) or the plain mean over uploaders (code)."""
    ema_decay: float = bounded(0.9999, at_least=0, at_most=1)
    """α of Ā ← α·Ā + (1 − α)·P̄ (paper and code)."""
    anchor_projection: Literal["mlp", "none"] = "mlp"
    """mlp: Ā⁰ = h_ψ(A) (paper and code; h_ψ is fixed, as in the code: the paper gives it no
    loss); none: Ā⁰ = A, the raw random anchors (Table 4's "w/o ER" ablation)."""
    inference: Inference = "proto_last"
    """proto_last: nearest P̄^c of the last round, only classes someone uploaded (code; the paper
    is silent); anchor: nearest Ā^c over all C classes; head: the client's own head."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.reg_distance is None:
            self.reg_distance = "mse" if reference else "euclid"
        if self.reg_weight is None:
            self.reg_weight = DEFAULT_REG_WEIGHT[self.reg_distance]
        if self.contrast_on is None:
            self.contrast_on = "samples" if reference else "prototypes"
        if self.margin_rule is None:
            self.margin_rule = "nearest" if reference else "pairwise"
        if self.proto_from is None:
            self.proto_from = "during_training" if reference else "post_update"
        if self.weighted is None:
            self.weighted = not reference


# --------------------------------------------------------------------------- anchors


def build_anchors(context: AlgorithmContext) -> torch.Tensor:
    """Ā⁰ [C, K] on the CPU, a function of the run seed only: A from the stream (seed,
    "fedsa-anchors"), h_ψ initialised from (seed, "fedsa-projection") inside a forked RNG (torch's
    global stream is left alone) and applied once in train mode, so each BatchNorm standardises
    every dimension over the C anchors. Nothing is trained; the result is detached.

    Under ``model.init=htfllib``, A and h_ψ are drawn as the reference draws them (issue 47
    item 3), in a forked RNG too: every ``clientSA`` ends its ``__init__`` with
    ``torch.manual_seed(0)``; ``FedSA.__init__`` (lokinko/FedSA@75bf106 ``serversa.py``) then
    builds ``projecter_linear`` (Linear, SyncBN, ReLU, Linear, SyncBN, ReLU: the two Linears
    draw) and only then ``random_center = torch.randn(C, K)``. The run seed stands for 0."""
    num_classes, dim = context.num_classes, context.feature_dim
    with torch.random.fork_rng(devices=[]):
        if context.model_init == "htfllib":
            torch.manual_seed(context.seed)
            projection = _projection(dim)
            anchors = torch.randn(num_classes, dim)
        else:
            anchors = torch.randn(num_classes, dim, generator=torch_generator(context.seed, "fedsa-anchors"))
            torch.manual_seed(derive_seed(context.seed, "fedsa-projection"))
            projection = _projection(dim)
    if context.options.anchor_projection == "none":
        return anchors
    projection.train()
    with torch.no_grad():
        return projection(anchors).contiguous()


def _projection(dim: int) -> nn.Sequential:
    """h_ψ = (Linear → BatchNorm → ReLU) × 2, K → K, drawn from torch's global RNG."""
    return nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
                         nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU())


@torch.no_grad()
def ema_update(anchors: torch.Tensor, class_ids: torch.Tensor, protos: torch.Tensor, decay: float) -> torch.Tensor:
    """Eq. 10 for the classes present: Ā^c ← α·Ā^c + (1 − α)·P̄^c for c in ``class_ids``; the
    other rows are kept. Returns a new tensor."""
    updated = anchors.clone()
    ids = class_ids.to(anchors.device)
    updated[ids] = decay * anchors[ids] + (1.0 - decay) * protos.to(anchors)
    return updated


# --------------------------------------------------------------------------- margins


@torch.no_grad()
def mean_margin(rows: torch.Tensor, rule: MarginRule) -> float | None:
    """The margin of a set of vectors (None for fewer than two): ``pairwise`` = the mean of
    ‖r_a − r_b‖ over the N(N−1) ordered pairs a ≠ b (Eq. 6); ``nearest`` = the mean over rows of
    the distance to the nearest other row (code)."""
    count = rows.shape[0]
    if count < 2:
        return None
    rows = rows.float()
    if rule == "nearest":
        return float(class_margins(rows).mean())
    off_diagonal = ~torch.eye(count, dtype=torch.bool, device=rows.device)
    return float(euclidean_distances(rows, rows)[off_diagonal].mean())


def client_margin(global_margin: float, local_margin: float | None) -> float:
    """d_i* = max(d_global, d_i); the global margin alone while the client has no margin of its
    own (never trained, or fewer than two classes; the code's 0.0 / −∞ give the same)."""
    return global_margin if local_margin is None else max(global_margin, local_margin)


# --------------------------------------------------------------------------- client losses


def anchor_regulariser(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
                       distance: RegDistance) -> torch.Tensor:
    """L_R (unweighted). ``euclid``: Σ_{c in the batch} ‖P^c − Ā^c‖₂ with P^c the batch's mean
    feature of class c (Eq. 5); ``mse``: (1/(B·K)) Σ_b ‖f_b − Ā^{y_b}‖² (code)."""
    if distance == "mse":
        return F.mse_loss(features, anchors[labels])
    means, counts = batch_class_means(features, labels, anchors.shape[0])
    return (torch.linalg.vector_norm(means - anchors, dim=1) * (counts > 0)).sum()


def own_class_offsets(labels: torch.Tensor, num_classes: int, margin: float) -> torch.Tensor:
    """d*·[k = c], [N, C]: FedTGP's margin offsets by a comparison rather than ``one_hot``, whose
    range check reads the labels' values and so cannot run under ``vmap`` (DP-SGD)."""
    return margin * (labels.unsqueeze(1) == torch.arange(num_classes, device=labels.device)).float()


def anchor_contrastive_loss(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
                            margin: float, on: ContrastOn) -> torch.Tensor:
    """L_MCL (Eq. 7): CE over −(‖p − Ā^k‖₂ + d*·[k = c]), FedTGP's margin loss against the
    anchors. ``samples``: p = each feature, c its label, mean over the batch (code);
    ``prototypes``: p = the batch's class means, mean over the classes in the batch."""
    num_classes = anchors.shape[0]
    if on == "samples":
        return margin_contrastive_loss(features, labels, anchors, own_class_offsets(labels, num_classes, margin))
    means, counts = batch_class_means(features, labels, num_classes)
    classes = torch.arange(num_classes, device=labels.device)  # every row, the absent ones weighted 0
    distances = euclidean_distances(means, anchors) + own_class_offsets(classes, num_classes, margin)
    losses = F.cross_entropy(-distances, classes, reduction="none")
    weights = (counts > 0).to(losses.dtype)
    return (losses * weights).sum() / weights.sum()


def calibration_loss(head: nn.Module, anchors: torch.Tensor) -> torch.Tensor:
    """L_CC (Eq. 8): −(1/C) Σ_c log softmax_c(h_i(Ā^c)), every class's anchor through the local
    head (bias included, as in the code); the anchors are constants, so only the head learns."""
    return F.cross_entropy(head(anchors), torch.arange(anchors.shape[0], device=anchors.device))


# --------------------------------------------------------------------------- client


class PrototypeMemory(nn.Module):
    """The prototypes a client uploaded at its last participation (buffers, so the runtime
    checkpoints them): its local margin d_i at the next one. With proto_from=post_update they are
    the class means of the current model, as the client has not changed since."""

    protos: torch.Tensor  # buffers (register_buffer)
    present: torch.Tensor

    def __init__(self, num_classes: int, feature_dim: int) -> None:
        super().__init__()
        self.register_buffer("protos", torch.zeros(num_classes, feature_dim))
        self.register_buffer("present", torch.zeros(num_classes, dtype=torch.bool))

    def rows(self) -> torch.Tensor:
        return self.protos[self.present]

    @torch.no_grad()
    def store(self, class_ids: torch.Tensor, protos: torch.Tensor) -> None:
        ids = class_ids.to(self.protos.device)
        self.protos.zero_()
        self.present.zero_()
        self.protos[ids] = protos.to(self.protos)
        self.present[ids] = True


def _memory(client: ClientState) -> PrototypeMemory:
    """The client's :class:`PrototypeMemory` (``init_client`` puts it among the client's modules)."""
    return cast(PrototypeMemory, client.modules[MEMORY])


class FedSAClient(FedProtoClient):
    """FedProto's upload (P_i^c for the classes held, counts when ``weighted``), FedSA's losses."""

    capturable_step = False  # a loss of its own, not checked for host syncs

    def init_client(self, client: ClientState) -> None:
        client.modules[MEMORY] = PrototypeMemory(self.context.num_classes, self.context.feature_dim).to(client.device)

    def margins(self, client: ClientState, anchors: torch.Tensor) -> tuple[float, float | None]:
        """(d_global of the downloaded anchors, d_i of the client's last upload), this round's."""
        rule = self.options.margin_rule
        global_margin = mean_margin(anchors, rule)
        assert global_margin is not None, "C >= 2 anchors"
        return global_margin, mean_margin(_memory(client).rows(), rule)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options = self.options
        anchors = knowledge["anchors"].to(client.device)
        margin = client_margin(*self.margins(client, anchors))  # held for the round, no gradient
        head = client.model.head

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = F.cross_entropy(batch.logits, batch.labels)
            if options.reg_weight:
                loss = loss + options.reg_weight * anchor_regulariser(
                    batch.features, batch.labels, anchors, options.reg_distance)
            if options.mcl_weight:
                loss = loss + options.mcl_weight * anchor_contrastive_loss(
                    batch.features, batch.labels, anchors, margin, options.contrast_on)
            if options.cc_weight:
                loss = loss + options.cc_weight * calibration_loss(head, anchors)
            return loss

        class_ids, protos, loss_sum, seen = self.train_with_prototypes(client, loss_fn, generator)
        _memory(client).store(class_ids, protos)
        return TrainResult(self.make_upload(client, class_ids, protos), loss_sum, seen)

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        rule = self.options.inference
        if rule == "head":
            return logits.argmax(dim=1)
        if rule == "anchor":
            return euclidean_distances(features, knowledge["anchors"].to(features.device)).argmin(dim=1)
        classes = torch.nonzero(knowledge["proto_present"]).flatten()
        last = {"class_ids": classes, "protos": knowledge["protos"][classes]}
        return super().predict(client, last, features, logits)  # −1 before any aggregation


# --------------------------------------------------------------------------- server


class FedSAServer(ServerAlgorithm):
    """P̄ = FedProto's server on the round's uploads; then the EMA of the anchors present."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        width = context.feature_dim
        fields: PayloadSpec = (Field("class_ids", torch.int64), Field("anchors", torch.float32, (width,)))
        if context.options.inference == "proto_last":
            fields += (Field("protos", torch.float32, (width,)), Field("proto_present", torch.bool))
        return fields

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.prototypes = FedProtoServer(context)
        self.anchors = build_anchors(context)

    def download(self) -> Payload:
        """All C rows: class_ids = 0..C−1, Ā, and (proto_last) P̄ dense with its presence mask."""
        num_classes = self.context.num_classes
        payload = {"class_ids": torch.arange(num_classes), "anchors": self.anchors}
        if self.options.inference == "proto_last":
            protos, present = dense_prototypes(self.prototypes.download(), num_classes)
            payload.update(protos=protos, proto_present=present)
        return payload

    def theory_download_floats(self) -> int:
        """K·C anchors, plus K·C for P̄ when clients classify with it."""
        tables = 2 if self.options.inference == "proto_last" else 1
        return tables * self.context.feature_dim * self.context.num_classes

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        self.prototypes.validate_upload(client_id, upload)

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        before = self.anchors
        diagnostics = self.prototypes.update(uploads, round_index, generator)
        table = self.prototypes.download()
        self.anchors = ema_update(before, table["class_ids"], table["protos"], self.options.ema_decay)
        return {**diagnostics, **self.anchor_diagnostics(uploads, before, table["class_ids"])}

    @torch.no_grad()
    def anchor_diagnostics(self, uploads: dict[int, Payload], before: torch.Tensor,
                           updated: torch.Tensor) -> dict[str, float]:
        """``global_margin``: d_global of the new anchors (what clients use next round);
        ``local_margin_mean``: mean d_i of the uploads with two or more classes (what those
        clients use at their next participation) and ``local_margin_above_global``: the share of
        them above d_global; ``anchor_drift``: mean ‖Ā_{t+1}^c − Ā_t^c‖ over the classes moved;
        ``upload_to_anchor`` / ``upload_nearest_anchor``: mean ‖P_i^c − Ā_t^c‖ and the share of
        uploads whose nearest anchor is their own class's."""
        rule, num_classes = self.options.margin_rule, self.context.num_classes
        global_margin = mean_margin(self.anchors, rule)
        assert global_margin is not None, "C >= 2 anchors"
        result: dict[str, float] = {"global_margin": float(global_margin)}
        local = [m for m in (mean_margin(uploads[cid]["protos"], rule) for cid in sorted(uploads)) if m is not None]
        if local:
            result["local_margin_mean"] = sum(local) / len(local)
            result["local_margin_above_global"] = sum(m > global_margin for m in local) / len(local)
        if updated.numel():
            result["anchor_drift"] = float((self.anchors[updated] - before[updated]).norm(dim=1).mean())
        anchors = {"class_ids": torch.arange(num_classes), "protos": before}
        nothing = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, before.shape[1])}
        fit = global_prototype_diagnostics(uploads, num_classes, anchors, nothing)
        result["upload_to_anchor"] = fit["upload_to_global"]
        result["upload_nearest_anchor"] = fit["upload_nearest_own"]
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"anchors": self.anchors, "prototypes": self.prototypes.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchors = state["anchors"].float().cpu()
        self.prototypes.load_state_dict(state["prototypes"])


register_algorithm("fedsa", server=FedSAServer, client=FedSAClient, options=FedSAOptions,
                   summary="semantic anchors moved by EMA; anchor regulariser, margin contrastive loss and "
                           "classifier calibration (Zhou et al. 2025)", private_release=True,
                   conformance=ConformanceHints(ranks_checked_in="tests/algorithms/test_fedsa.py, on 3 torchrun "
                                                                 "ranks and mpirun -n 3"))
