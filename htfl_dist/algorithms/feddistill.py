"""FedDistill (Jeong et al. 2018; HtFLlib's ``FD``).

Clients share per-class mean logits instead of features or weights: client i uploads l_i^c, the
mean of its logits z = h_i(f_i(x)) over its samples of class c, for the classes it holds; the
server averages them per class over the round's uploaders (ḡ^c, unweighted, nothing remembered);
clients then train

    L_i = CE(z, y) + λ · (1/B) Σ_{b : ḡ^{y_b} exists} ℓ(z_b, ḡ^{y_b})

and classify with their own head. Any head with C outputs works, so heterogeneous heads (HtC4)
are fine. Up m_i·C floats per client, down (at most) C·C.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import (
    ClassMeans,
    ClassMeanServer,
    class_means,
    class_row_fields,
    dense_class_table,
)
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, TrainResult
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.config import bounded
from htfl_dist.payload import Payload, PayloadSpec

DistillLoss = Literal["softmax", "raw", "mse"]
MissingRows = Literal["mask", "self_target"]


@dataclass
class FedDistillOptions:
    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib HEAD's value (distill_loss=raw, missing_rows=self_target)."""
    distill_loss: DistillLoss | None = None
    """ℓ: softmax = −Σ softmax(ḡ)·log softmax(z) (KD at T = 1; default); raw = −Σ ḡ·log softmax(z)
    (HtFLlib HEAD: the raw averaged logits as a target); mse = ‖z − ḡ‖²/C (HtFLlib before 2024-04,
    when the FedTGP/FedKTL tables were made)."""
    missing_rows: MissingRows | None = None
    """Rows whose class has no global logit: mask = they add nothing (still counted in B; default);
    self_target = their target is their own detached logits (HtFLlib; a non-zero gradient under raw)."""
    logits_from: Literal["during_training", "post_update"] = "during_training"
    """during_training: mean of each batch's logits before its step, over the local epochs (HtFLlib);
    post_update: an eval-mode pass over the training split after training."""
    reg_weight: float = bounded(1.0, at_least=0)
    """λ (FedTGP appendix: γ = 1)."""

    def validate(self) -> None:
        reference = self.compat == "reference"
        if self.distill_loss is None:
            self.distill_loss = "raw" if reference else "softmax"
        if self.missing_rows is None:
            self.missing_rows = "self_target" if reference else "mask"


def logit_fields(num_classes: int) -> PayloadSpec:
    return class_row_fields("logits", num_classes, num_classes)


def distillation_term(logits: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, available: torch.Tensor,
                      loss: DistillLoss, missing_rows: MissingRows) -> torch.Tensor:
    """(1/B) Σ_b ℓ(z_b, target_b): target_b = ḡ^{y_b} where it exists; other rows are dropped
    (``mask``) or aim at their own detached logits (``self_target``). Every row counts in B."""
    has_target = available[labels]
    target = torch.where(has_target.unsqueeze(1), table[labels], logits.detach())
    if loss == "mse":
        per_row = (logits - target).pow(2).mean(dim=1)
    else:
        weights = F.softmax(target, dim=1) if loss == "softmax" else target
        per_row = -(weights * F.log_softmax(logits, dim=1)).sum(dim=1)
    if missing_rows == "mask":
        per_row = per_row * has_target
    return per_row.mean()


class FedDistillClient(ClientAlgorithm):
    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return logit_fields(context.num_classes)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        options, num_classes = self.options, self.context.num_classes
        has_global = knowledge["class_ids"].numel() > 0  # round 0: CE only
        table, available = dense_class_table(knowledge, "logits", num_classes, client.device)

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = F.cross_entropy(batch.logits, batch.labels)
            if has_global:
                loss = loss + options.reg_weight * distillation_term(
                    batch.logits, batch.labels, table, available, options.distill_loss, options.missing_rows)
            return loss

        during = options.logits_from == "during_training"
        seen_logits = ClassMeans(num_classes, num_classes, client.device) if during else None
        on_batch = (lambda batch: seen_logits.add(batch.logits, batch.labels)) if seen_logits is not None else None
        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator, on_batch=on_batch)
        class_ids, rows = (seen_logits.rows() if seen_logits is not None
                           else class_means(client, num_classes, "logits"))
        return TrainResult({"class_ids": class_ids, "logits": rows.float()}, loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """C·|C_i| (FedTGP Table 5: Σ_i C·(C_i + C) with the download)."""
        return self.context.num_classes * int(client.classes.numel())


class FedDistillServer(ClassMeanServer):
    """ḡ^c = unweighted mean of the round's l_i^c; downloads C·C floats in the papers' count."""

    key = "logits"

    @classmethod
    def row_width(cls, context: AlgorithmContext) -> int:
        return context.num_classes


register_algorithm("feddistill", server=FedDistillServer, client=FedDistillClient, options=FedDistillOptions,
                   summary="per-class mean logits, distilled into every client (Jeong et al. 2018; HtFLlib FD)",
                   private_release=True)
