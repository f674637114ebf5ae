"""FedPCL (Tan et al., NeurIPS 2022), without pre-trained backbones, as PFLlib adapts it
(docs/algorithms.md, "FedPCL").

Every client trains its whole model on a prototype-wise contrastive loss and has no CE head.
With z = f_i(x)/‖f_i(x)‖ its normalised feature:

- upload: c_i^k = mean of z over the client's samples of class k (a mean of unit vectors, not
  normalised again), for the classes it holds;
- server: the global prototypes c̄^k = mean of this round's c_i^k over their uploaders, and the
  set of every client's latest local prototypes (kept across rounds); both go down, in one
  class-indexed table whose ``owners`` column says whose row it is (−1: global);
- client loss, τ the temperature, ℓ(z, y; T) = −log softmax_k(z·T^k/τ)[y] over the classes k
  that table T has:

      L = ℓ(z, y; c̄) + (1/m) Σ_j ℓ(z, y; c_j ⊕ c̄)

  averaged over the batch, with c_j ⊕ c̄ client j's local prototypes with c̄^k in place of the
  classes j does not hold, and m the clients in the set (the client itself included);
- inference: the class of the largest z·c^k over the client's own prototypes c_i ⊕ c̄.

A client with nothing downloaded yet (the first round) does not train: it only uploads its
prototypes, as PFLlib does. Only the paper's abstract could be read here, so every default
follows one code, PFLlib's (TsingZ0/PFLlib@d832e76 clientpcl.py: τ = 1, clipping at 10), the
one whose whole method runs here; ``compat=official`` takes the official code's settings
(yuetan031/FedPCL@0c3895b lib/update.py) where they apply (issue 47).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import (
    ClassMeanServer,
    class_means,
    class_row_fields,
    dense_class_table,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, TrainResult
from htfl_dist.algorithms.registry import register_algorithm
from htfl_dist.algorithms.training import Batch, gradient_clipper, run_local_training
from htfl_dist.config import bounded
from htfl_dist.config.rules import Identity, declared
from htfl_dist.payload import Field, Payload, PayloadSpec

LocalReduction = Literal["mean", "sum"]
LocalFrom = Literal["all", "others"]
PredictWith = Literal["local", "local_own", "global"]
PredictScore = Literal["dot", "distance"]
GLOBAL_OWNER = -1
"""``owners`` value of a global prototype's row in the download."""


PFLLIB = "TsingZ0/PFLlib@d832e76"
"""The code every default follows (issue 47): PFLlib's adaptation, ``system/flcore/clients/clientpcl.py``."""
OFFICIAL = "yuetan031/FedPCL@0c3895b"
"""The authors' code (``lib/update.py``), whose settings ``compat=official`` takes."""
PFLLIB_CLIP_GRAD_NORM = 10.0
"""``clientpcl.py:clientPCL.train``: ``clip_grad_norm_(self.model.parameters(), 10)``."""
SourceCode = Literal["pfllib", "official"]


@dataclass
class FedPCLOptions:
    compat: SourceCode = declared("pfllib", identity=Identity(added_later=True, before="official"))
    """Which code the knobs left unset follow. pfllib (default): PFLlib's adaptation, the one
    source whose whole method runs here (the official loss contrasts two augmented views of every
    sample, which this engine does not make) and the form HtFLlib users run: tau=1.0 (``-tau``),
    global_term=true, local_reduction=mean, predict_with=local, predict_score=dot,
    clip_grad_norm=10. official: the authors' code's settings where they apply to this loss:
    tau=0.07, global_term=false, local_reduction=sum, predict_with=local_own,
    predict_score=distance, no clipping. (Before issue 47 the defaults mixed the two: τ and
    clipping the official code's, the rest PFLlib's; those runs keep their hash with the five
    knobs written out and ``compat=official``, which then changes nothing.)"""
    tau: float | None = bounded(None, above=0, optional=True, note="null: the compat preset's")
    """τ, the temperature of both contrastive terms (PFLlib ``main.py`` ``-tau`` default 1.0; the
    official ``update.py:LocalUpdate.update_weights_lg`` ``ConLoss(temperature=0.07)``)."""
    global_term: bool | None = None
    """Include ℓ(z, y; c̄), the contrast against the global prototypes (PFLlib
    ``clientPCL.train``, its term on ``global_protos_emb``). False: the local-prototype terms
    alone, as the official code trains."""
    local_reduction: LocalReduction | None = None
    """How the m local-prototype terms combine: their mean (PFLlib ``clientPCL.train``, each
    divided by ``len(client_protos_set)``) or their sum (the official code)."""
    local_from: LocalFrom = "all"
    """Whose local prototypes a client contrasts with: every client in the set, itself included
    (both reference codes), or the others only."""
    predict_with: PredictWith | None = None
    """Inference prototypes: the client's own c_i ⊕ c̄ (PFLlib ``clientPCL.test_metrics``: its
    prototypes padded with the global ones); local_own: its own classes only (the official code);
    global: c̄."""
    predict_score: PredictScore | None = None
    """How z is scored against a prototype: z·c (PFLlib ``test_metrics``, ``torch.dot(r, pro)``)
    or −‖z − c‖ (the official code's MSE)."""
    clip_grad_norm: float | None = bounded(None, identity=Identity(hashed_as="grad_clip"), at_least=0,
                                           optional=True, note="0: no clipping; null: the compat preset's")
    """Clip the client's gradient to this L2 norm before each step (PFLlib ``clientPCL.train``:
    10, "prevent divergency"; the official code clips nothing); 0 or, under compat=official,
    unset: no clipping. Named ``grad_clip`` until 2026-11-29 (hashed so)."""

    def validate(self) -> None:
        pfllib = self.compat == "pfllib"
        if self.tau is None:
            self.tau = 1.0 if pfllib else 0.07
        if self.global_term is None:
            self.global_term = pfllib
        if self.local_reduction is None:
            self.local_reduction = "mean" if pfllib else "sum"
        if self.predict_with is None:
            self.predict_with = "local" if pfllib else "local_own"
        if self.predict_score is None:
            self.predict_score = "dot" if pfllib else "distance"
        if self.clip_grad_norm is None and pfllib:
            self.clip_grad_norm = PFLLIB_CLIP_GRAD_NORM


def prototype_logits(features: torch.Tensor, tables: torch.Tensor, available: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """z·T^k/τ for every table T (``tables`` [m, C, K], ``available`` [m, C]) and sample z
    (``features`` [B, K], normalised here): [m, B, C], −inf where a table lacks class k."""
    z = F.normalize(features, dim=1)
    logits = torch.einsum("bk,mck->mbc", z, tables) / tau
    return logits.masked_fill(~available.unsqueeze(1), float("-inf"))


def contrastive_terms(features: torch.Tensor, labels: torch.Tensor, tables: torch.Tensor,
                      available: torch.Tensor, tau: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """ℓ(z, y; T) = −log softmax_k(z·T^k/τ)[y] averaged over the batch, one value per table ([m]).

    A sample whose class a table lacks adds nothing to that table's mean (it has no positive
    there); ``weights`` (0 for a padded row) leave rows out."""
    logits = prototype_logits(features, tables, available, tau)
    known = available[:, labels]  # [m, B]: the table has the sample's class
    safe = torch.where(known, labels.expand_as(known), available.float().argmax(dim=1, keepdim=True))
    losses = -logits.log_softmax(dim=2).gather(2, safe.unsqueeze(2)).squeeze(2)
    row_weights = known.float() if weights is None else known.float() * weights
    # weighted_mean per table, all tables at once
    return (torch.where(known, losses, 0.0) * row_weights).sum(dim=1) / row_weights.sum(dim=1).clamp(min=1)


def split_download(knowledge: Payload, num_classes: int, device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """(global table [C, K], its mask [C], {client: (its own table [C, K], its mask [C])}) from
    a download's (class_ids, owners, protos) rows."""
    class_ids, owners, protos = knowledge["class_ids"], knowledge["owners"], knowledge["protos"]

    def table_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_class_table({"class_ids": class_ids[rows], "protos": protos[rows]}, "protos", num_classes, device)

    tables = {int(owner): table_of(owners == owner) for owner in torch.unique(owners).tolist()
              if owner != GLOBAL_OWNER}
    global_table, global_mask = table_of(owners == GLOBAL_OWNER)  # all zeros before the first update
    return global_table, global_mask, tables


def padded(own: tuple[torch.Tensor, torch.Tensor], global_table: torch.Tensor, global_mask: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """c_j ⊕ c̄: client j's prototypes, c̄^k for the classes it does not hold (both reference codes)."""
    table, mask = own
    return torch.where(mask.unsqueeze(1), table, global_table), mask | global_mask


class FedPCLClient(ClientAlgorithm):
    """Trains on L = ℓ(z, y; c̄) + reduce_j ℓ(z, y; c_j ⊕ c̄); uploads the means of z per class;
    classifies by the most similar prototype (``predict_with``, ``predict_score``)."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return class_row_fields("protos", context.feature_dim, context.num_classes)

    def loss_tables(self, client_id: int, knowledge: Payload, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tables [1 + m, C, K], masks [1 + m, C], term weights [1 + m]): c̄ first, then each
        client's c_j ⊕ c̄ in client-id order, weighted as ``global_term``, ``local_reduction`` and
        ``local_from`` say."""
        options = self.options
        global_table, global_mask, locals_ = split_download(knowledge, self.context.num_classes, device)
        owners = [j for j in sorted(locals_) if options.local_from == "all" or j != client_id]
        tables, masks = [global_table], [global_mask]
        for j in owners:
            table, mask = padded(locals_[j], global_table, global_mask)
            tables.append(table)
            masks.append(mask)
        share = 1.0 / max(len(owners), 1) if options.local_reduction == "mean" else 1.0
        weights = torch.tensor([1.0 if options.global_term else 0.0] + [share] * len(owners), device=device)
        return torch.stack(tables), torch.stack(masks), weights

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_sum, seen = 0.0, 0
        if knowledge["class_ids"].numel() > 0:  # nothing to contrast with before the first download
            tables, masks, term_weights = self.loss_tables(client.client_id, knowledge, client.device)
            tau = self.options.tau

            def loss_fn(batch: Batch) -> torch.Tensor:
                terms = contrastive_terms(batch.features, batch.labels, tables, masks, tau, batch.weights)
                return (terms * term_weights).sum()

            loss_sum, seen = run_local_training(client, self.context, loss_fn, generator,
                                                before_step=gradient_clipper(client.model.parameters(),
                                                                             self.options.clip_grad_norm))
        class_ids, protos = class_means(client, self.context.num_classes, "features", unit_rows=True)
        return TrainResult({"class_ids": class_ids, "protos": protos}, loss_sum, seen)

    def theory_upload_floats(self, client: ClientState) -> int:
        """K·|C_i|: one prototype per class held."""
        return self.context.feature_dim * int(client.classes.numel())

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        device = features.device
        global_table, global_mask, locals_ = split_download(knowledge, self.context.num_classes, device)
        table, mask = global_table, global_mask
        own = locals_.get(client.client_id) if self.options.predict_with != "global" else None
        if own is not None:  # a client not yet in the set falls back on c̄
            table, mask = own if self.options.predict_with == "local_own" else padded(own, global_table, global_mask)
        if not bool(mask.any()):
            return torch.full((features.shape[0],), -1, dtype=torch.int64, device=device)
        z = F.normalize(features, dim=1)
        if self.options.predict_score == "dot":
            scores = z @ table.t()
        else:
            scores = -torch.cdist(z, table, compute_mode="donot_use_mm_for_euclid_dist")
        return scores.masked_fill(~mask, float("-inf")).argmax(dim=1)


class FedPCLServer(ClassMeanServer):
    """c̄^k = mean of this round's uploads for class k (absent when nobody uploaded it); the set of
    every client's latest upload, kept across rounds. Both go down in one table."""

    key = "protos"

    @classmethod
    def row_width(cls, context: AlgorithmContext) -> int:
        return context.feature_dim

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        most = context.num_classes * (context.num_clients + 1)
        return (Field("class_ids", torch.int64, max_rows=most), Field("owners", torch.int64, max_rows=most),
                Field("protos", torch.float32, (context.feature_dim,), most))

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.local_set: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        metrics = super().update(uploads, round_index, generator)
        for client_id in sorted(uploads):
            self.local_set[client_id] = (uploads[client_id]["class_ids"].clone(), uploads[client_id]["protos"].float())
        metrics["set_clients"] = float(len(self.local_set))
        return metrics

    def diagnostics(self, uploads: dict[int, Payload], previous: Payload) -> dict[str, Any]:
        return global_prototype_diagnostics(uploads, self.context.num_classes, super().download(),
                                            {"class_ids": previous["class_ids"][previous["owners"] == GLOBAL_OWNER],
                                             "protos": previous["protos"][previous["owners"] == GLOBAL_OWNER]})

    def download(self) -> Payload:
        class_ids, owners, protos = [self.class_ids], [torch.full_like(self.class_ids, GLOBAL_OWNER)], [self.rows]
        for client_id in sorted(self.local_set):
            ids, rows = self.local_set[client_id]
            class_ids.append(ids)
            owners.append(torch.full_like(ids, client_id))
            protos.append(rows)
        return {"class_ids": torch.cat(class_ids), "owners": torch.cat(owners), "protos": torch.cat(protos)}

    def theory_download_floats(self) -> int:
        """K·C·(1 + N): the global prototypes and every client's (padded) local ones, as PFLlib sends."""
        return self.context.feature_dim * self.context.num_classes * (1 + self.context.num_clients)

    def state_dict(self) -> dict[str, Any]:
        return self.download()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        class_ids, owners, protos = state["class_ids"], state["owners"], state["protos"]
        is_global = owners == GLOBAL_OWNER
        self.class_ids, self.rows = class_ids[is_global], protos[is_global]
        self.local_set = {int(j): (class_ids[owners == j], protos[owners == j])
                          for j in torch.unique(owners[~is_global]).tolist()}


register_algorithm("fedpcl", server=FedPCLServer, client=FedPCLClient, options=FedPCLOptions,
                   summary="prototype-wise contrastive learning against global and every client's local "
                           "prototypes, no CE head (Tan et al. 2022, PFLlib's form without backbones)")
