"""FedOC (Guo et al., arXiv 2502.16119 v1, 2025): trainable global prototypes trained with
orthogonality constraints (docs/algorithms.md, "FedOC and FedORGP").

The server is FedTGP's (``fedtgp.TrainablePrototypeServer``: P̂^c = F(P̃^c), one trainable vector
per class and a two-layer F, all C prototypes sent down), trained for 1 epoch per round with the
orthogonality-constraint loss on cosine similarity instead of the margin contrastive loss
(Eq. 5–8): on a mini-batch B of uploaded pairs (P, c),

    s = (1/|B|) Σ cos(P, P̂^c),   d = (1/(|B|·n)) Σ Σ_{c̄≠c} |cos(P, P̂^c̄)|,   L_OC = λ_s·(1 − s) + γ·d

with n = |C| (paper) or C − 1 (reference code). Clients upload FedProto's prototypes (P_i^c, c)
for the classes they hold, train CE + λ_c·(1 − (1/|B|) Σ cos(r, P̂^y)) (Eq. 11–12) and classify with
their own head. In round 1 the clients align to the untrained P̂ (Algorithm 1 sends P̂ before any
server training), or train with CE only (``first_round=ce_only``, the reference code).

FedORGP (``fedorgp``, version 2 of the same paper, the method renamed; ``algorithms/fedorgp.py``)
is FedOC's classes with two switches the authors' code added in July 2025 and turns on by
default, and which the paper's text does not describe: the client drops outlying features of each class before taking
its mean (:func:`outlier_mask`), and the server weighs both terms of its loss with sigmoids of the
cosines (:func:`weighted_orthogonality_loss`). Its d is normalised by |B|·(|C| − 1) (FedORGP
Eq. 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import class_prototypes, dense_prototypes
from htfl_dist.algorithms.fedproto import PrototypeClient
from htfl_dist.algorithms.fedtgp import TrainablePrototypeServer
from htfl_dist.algorithms.interface import ClientAlgorithm, ClientState, TrainResult
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.payload import Payload

InterNorm = Literal["all_classes", "other_classes"]
FirstRound = Literal["initial_prototypes", "ce_only"]
PAPER_SERVER_BATCH = 32
"""|B| of Eq. 5–6: "the batch size is set to 32 for all experiments" (paper §5.1)."""


@dataclass
class FedOCOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes the reference code's value (FedORGP 85ae3b6, built on
    HtFLlib): reg_weight = 10, inter_norm = other_classes, server batch = the client batch size,
    first_round = ce_only."""
    reg_weight: float | None = bounded(None, at_least=0, optional=True)
    """λ_c, the weight of the client's 1 − cos alignment: 100 (paper: Table 6's best cell, 61.15, the
    one next to Table 1's 61.12); htfllib: 10 (every run script of the reference code; Table 6 gives
    it 57.35)."""
    intra_weight: float = bounded(1.0, at_least=0)
    """λ_s, the server's intra-class weight (paper and code: 1)."""
    inter_weight: float = bounded(10.0, at_least=0)
    """γ, the server's inter-class (orthogonality) weight (paper and code: 10)."""
    inter_norm: InterNorm | None = None
    """Normaliser of d: all_classes = |B|·|C| (paper Eq. 6); other_classes = |B|·(C − 1), the
    number of terms summed (htfllib)."""
    server_batch_size: int | None = bounded(None, at_least=1, optional=True)
    """Pairs per server step: 32 (paper); htfllib: unset = the client batch size (the code's
    ``args.batch_size``, 32 in its runs)."""
    server_epochs: int = bounded(1, at_least=1)
    """Epochs over the round's pairs (paper and code: 1)."""
    server_lr: float = bounded(0.01, above=0)
    """SGD learning rate of the prototype generator (paper and code: 0.01)."""
    hidden_dim: int | None = bounded(None, at_least=1, optional=True)
    """Width of F's hidden layer (default K, as the code's server_hidden_dim = feature_dim)."""
    first_round: FirstRound | None = None
    """What round 1's clients align to. initial_prototypes: the server sends P̂ = F(P̃) of its
    untrained generator and clients train CE + λ_c·L_R against it (paper Algorithm 1: the server
    sends P̂ at the start of every round, round 1 included, and clients train by Eq. 11);
    ce_only: nothing goes down before the first server update, so round 1 is CE alone (htfllib:
    the reference code starts with no global prototypes)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.first_round is None:
            self.first_round = "ce_only" if reference else "initial_prototypes"
        if self.reg_weight is None:
            self.reg_weight = 10.0 if reference else 100.0
        if self.inter_norm is None:
            self.inter_norm = "other_classes" if reference else "all_classes"
        if self.server_batch_size is None and not reference:
            self.server_batch_size = PAPER_SERVER_BATCH


def cosine_table(rows: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
    """cos(rows_i, protos_j) = rows_i·protos_j / (‖rows_i‖₂ ‖protos_j‖₂), [N, M] (Eq. 7). Each
    vector is L2-normalised first, as the reference code does; a zero vector has cosine 0."""
    return F.normalize(rows, dim=1) @ F.normalize(protos, dim=1).t()


def orthogonality_loss(pairs: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor,
                       intra_weight: float, inter_weight: float, inter_norm: InterNorm) -> torch.Tensor:
    """L_OC = λ_s·(1 − s) + γ·d on a mini-batch of uploaded pairs (Eq. 5, 6, 8):

        s = (1/|B|) Σ_b cos(P_b, P̂^{c_b})
        d = (1/(|B|·n)) Σ_b Σ_{c̄ ≠ c_b} |cos(P_b, P̂^c̄)|,   n = C (all_classes) or C − 1 (other_classes)

    over all C global prototypes, including classes nobody uploaded."""
    cos = cosine_table(pairs, global_protos)
    batch, num_classes = cos.shape
    own = F.one_hot(labels, num_classes).bool()
    s = cos.gather(1, labels.unsqueeze(1)).mean()
    others = num_classes if inter_norm == "all_classes" else max(num_classes - 1, 1)
    d = cos.abs().masked_fill(own, 0.0).sum() / (batch * others)
    return intra_weight * (1 - s) + inter_weight * d


def cosine_alignment(features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor,
                     available: torch.Tensor) -> torch.Tensor:
    """L_R = (1/|B|) Σ_b (1 − cos(r_b, P̂^{y_b})) (Eq. 12: 1 − the batch's mean cosine). A row
    whose class has no global prototype adds nothing but counts in |B| (FedOC's server sends
    every class, so this only matters for a hand-made table)."""
    cos = (F.normalize(features, dim=1) * F.normalize(table[labels], dim=1)).sum(dim=1)
    return ((1 - cos) * available[labels]).mean()


def _mean_over(values: torch.Tensor, mask: torch.Tensor) -> float | None:
    return float(values[mask].mean()) if bool(mask.any()) else None


@torch.no_grad()
def cosine_diagnostics(pairs: torch.Tensor, labels: torch.Tensor, global_protos: torch.Tensor) -> dict[str, float]:
    """How orthogonal the prototypes are, for the metrics row (a mean over nothing is left out):

    ``global_intra_cos``: mean over the round's pairs of cos(P_i^c, P̂^c) (s over every pair);
    ``global_inter_abs_cos``: mean over c ≠ c' of |cos(P̂^c, P̂^c')|, all C global prototypes;
    ``upload_intra_cos``: mean cos(P_i^c, P_j^c) over two uploads of one class (two clients);
    ``upload_inter_abs_cos``: mean |cos(P_i^c, P_j^c')| over two uploads of different classes."""
    num_classes = global_protos.shape[0]
    result: dict[str, float] = {}
    result["global_intra_cos"] = float(cosine_table(pairs, global_protos).gather(1, labels.unsqueeze(1)).mean())
    between = ~torch.eye(num_classes, dtype=torch.bool, device=global_protos.device)
    value = _mean_over(cosine_table(global_protos, global_protos).abs(), between)
    if value is not None:
        result["global_inter_abs_cos"] = value
    uploads = cosine_table(pairs, pairs)
    distinct = torch.ones_like(uploads, dtype=torch.bool).triu(diagonal=1)  # each unordered pair once
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    for key, values, mask in (("upload_intra_cos", uploads, distinct & same),
                              ("upload_inter_abs_cos", uploads.abs(), distinct & ~same)):
        value = _mean_over(values, mask)
        if value is not None:
            result[key] = value
    return result


class FedOCClient(PrototypeClient):
    """FedProto's upload (P_i^c after training, eval mode, for the classes held); the local loss
    CE + λ_c·L_R; inference with the client's own head."""

    capturable_step = False  # a loss of its own, not checked for host syncs

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        num_classes, weight = self.context.num_classes, self.options.reg_weight
        has_global = knowledge["class_ids"].numel() > 0  # none before the first update: CE only (first_round=ce_only)
        table, available = dense_prototypes(knowledge, num_classes, client.device)

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = F.cross_entropy(batch.logits, batch.labels)
            if has_global:
                loss = loss + weight * cosine_alignment(batch.features, batch.labels, table, available)
            return loss

        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator)
        class_ids, protos = self.local_prototypes(client)
        return TrainResult(self.make_upload(client, class_ids, protos), loss_sum, seen)

    def local_prototypes(self, client: ClientState) -> tuple[torch.Tensor, torch.Tensor]:
        """(class ids, P_i^c) after training: the class means of f_i(x) over every training sample
        (eval mode). FedORGP's client changes which samples enter each mean."""
        return class_prototypes(client, self.context.num_classes)

    predict = ClientAlgorithm.predict  # the head's argmax, not FedProto's nearest prototype


class FedOCServer(TrainablePrototypeServer):
    """FedTGP's trainable prototypes, trained with L_OC (``server_epochs`` = 1 per round). With
    ``first_round=initial_prototypes`` the untrained P̂ goes down before the first update too."""

    def download(self) -> Payload:
        if self.trained or self.options.first_round == "ce_only":
            return super().download()
        return {"class_ids": torch.arange(self.context.num_classes), "protos": self.global_prototypes().cpu()}

    def fit(self, pairs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> dict:
        options = self.options

        def loss_fn(rows: torch.Tensor, batch_labels: torch.Tensor, protos: torch.Tensor) -> torch.Tensor:
            return orthogonality_loss(rows, batch_labels, protos, options.intra_weight, options.inter_weight,
                                      options.inter_norm)

        server_loss = self.train_prototypes(pairs, labels, loss_fn, generator)
        return {"server_loss": server_loss, "server_pairs": int(pairs.shape[0])}

    def diagnostics(self, uploads: dict[int, Payload], pairs: torch.Tensor, labels: torch.Tensor,
                    previous: Payload) -> dict:
        return cosine_diagnostics(pairs, labels, self.global_prototypes())


register_algorithm("fedoc", server=FedOCServer, client=FedOCClient, options=FedOCOptions,
                   summary="trainable global prototypes with orthogonality constraints, cosine alignment "
                           "(Guo et al., arXiv 2502.16119 v1; fedorgp is its v2)", private_release=True,
                   # 3 of 6 clients a round: the run tests/algorithms/test_fedoc.py also checks (and resumes on
                   # mpirun), so the one-process run is shared
                   conformance=ConformanceHints(overrides=("join_ratio=0.5",),
                                                ranks_checked_in="tests/algorithms/test_fedoc.py, on mpirun -n 3 "
                                                                 "stopped after round 1 and resumed"))
