"""FedProto (Tan et al., AAAI 2022) (docs/algorithms.md, "FedProto").

Clients upload one prototype per class they hold; the server averages them per class;
clients regularise their features towards the global prototypes and classify by the
nearest global prototype.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms.class_rows import (
    ClassMeanServer,
    GroupClassMeans,
    batch_class_means,
    check_class_counts,
    class_prototypes,
    class_row_fields,
    dense_prototypes,
    euclidean_distances,
    global_prototype_diagnostics,
)
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    TrainResult,
)
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import (
    Batch,
    batch_cross_entropy,
    run_batched_training,
    run_local_training,
    weighted_mean,
)
from htfl_dist.config import bounded
from htfl_dist.config.rules import Identity, declared
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Field, Payload, PayloadSpec

ClientRegulariser = Literal["paper", "htfllib"]
PrototypeSource = Literal["post_update", "pre_update", "during_training"]
ProtoSamples = Literal["all", "full_batches"]
"""Which training samples a client's uploaded means cover (``proto_samples``)."""
DEFAULT_REG_WEIGHT = {"paper": 0.1, "htfllib": 10.0}


@dataclass
class PrototypeOptions:
    """Client-side options shared by the prototype methods (FedProto, FedTGP)."""

    client_reg: ClientRegulariser = "paper"
    """paper: λ·mean_c ‖P_i^c − P̂^c‖₂ over the batch's class means (Eq. 4/11);
    htfllib: λ·MSE(f(x), P̂^y) per sample, as the reference code does."""
    reg_weight: float | None = bounded(None, at_least=0, optional=True)
    """λ; default 0.1 for client_reg=paper, 10 for client_reg=htfllib."""
    proto_from: PrototypeSource = "post_update"
    """post_update (paper) | pre_update (HtFLlib FedTGP) | during_training (HtFLlib FedProto)."""
    proto_samples: ProtoSamples = declared("all", identity=Identity(added_later=True))
    """Which training samples the uploaded means cover: all of them (the papers' class means), or
    full_batches, the samples of the full batches in stored order, as HtFLlib's ``collect_protos``
    reads its ``DataLoader(shuffle=False, drop_last=True)`` (FedTGP: TsingZ0/HtFLlib@728e52a
    ``clienttgp.py``; a client without one full batch uploads nothing). Goes with a pass before or
    after training (``proto_from``), not with during_training."""

    def validate(self) -> None:
        if self.reg_weight is None:
            self.reg_weight = DEFAULT_REG_WEIGHT[self.client_reg]
        if self.proto_samples == "full_batches" and self.proto_from == "during_training":
            raise ConfigError("algo.proto_samples=full_batches takes the prototypes in one pass before or after "
                              "training; with algo.proto_from=during_training set algo.proto_samples=all")


@dataclass
class FedProtoOptions(PrototypeOptions):
    weighted: bool = False
    """Weight the server mean by class counts (paper Eq. 3; puts counts on the wire)."""


def prototype_fields(context: AlgorithmContext) -> PayloadSpec:
    """Class-indexed prototype rows (K wide): only the classes the sender has travel."""
    return class_row_fields("protos", context.feature_dim, context.num_classes)


def prototype_regulariser(options: PrototypeOptions, features: torch.Tensor, labels: torch.Tensor,
                          table: torch.Tensor, available: torch.Tensor,
                          weights: torch.Tensor | None = None) -> torch.Tensor:
    """λ·φ between this batch's features and the global prototypes (0 where none exists).
    ``weights`` (``Batch.weights``: 0 for the padding rows of a batched step) leave rows out."""
    reg_weight = options.reg_weight
    assert reg_weight is not None  # validate() puts client_reg's default in its place
    if options.client_reg == "htfllib":
        target = torch.where(available[labels].unsqueeze(1), table[labels], features.detach())
        if weights is None:
            return reg_weight * F.mse_loss(features, target)
        return reg_weight * weighted_mean((features - target).pow(2).mean(dim=1), weights)
    batch_protos, counts = batch_class_means(features, labels, table.shape[0], row_weights=weights,
                                             kept_classes=available)
    present = counts > 0
    distances = torch.linalg.vector_norm(batch_protos - table, dim=1) * present  # gradient 0 at 0
    return reg_weight * distances.sum() / present.sum().clamp(min=1)


class PrototypeClient(ClientAlgorithm):
    """Client of the prototype methods: CE + λ·φ(P_i, P̂), upload P_i^c for c ∈ C_i,
    classify by the nearest global prototype."""

    capturable_step = True
    """FedProto's and FedTGP's loss has no host sync (written for vmap: torch.where and gathers);
    a subclass with a loss of its own says so again or not (FedOC, FPL, FedSA, ProtoNorm do not)."""

    trains_concurrently = True
    """Nothing of a client's training is kept on the algorithm object (the loss and the running
    means are made per call); subclasses with a loss of their own do not claim it."""

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return prototype_fields(context)

    def loss_function(self, knowledge: Payload, device: torch.device) -> Callable[[Batch], torch.Tensor]:
        """CE + λ·φ towards the downloaded prototypes (CE alone before any exist): one function
        for every client of the round, so a group of clients can train with it batched."""
        has_global = knowledge["class_ids"].numel() > 0
        table, available = dense_prototypes(knowledge, self.context.num_classes, device)

        def loss_fn(batch: Batch) -> torch.Tensor:
            loss = batch_cross_entropy(batch)
            if has_global:
                loss = loss + prototype_regulariser(self.options, batch.features, batch.labels, table, available,
                                                    batch.weights)
            return loss

        return loss_fn

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        loss_fn = self.loss_function(knowledge, client.device)
        class_ids, protos, loss_sum, seen = self.train_with_prototypes(client, loss_fn, generator)
        return TrainResult(self.make_upload(client, class_ids, protos), loss_sum, seen)

    def train_group(self, clients: list[ClientState], knowledge: Payload, round_index: int,
                    generators: list[torch.Generator]) -> list[TrainResult]:
        loss_fn = self.loss_function(knowledge, clients[0].device)
        outcomes = self.prototypes_around(clients, lambda on_batch: run_batched_training(
            clients, self.context, loss_fn, generators, on_batch=on_batch))
        return [TrainResult(self.make_upload(client, class_ids, protos), loss_sum, seen)
                for client, (class_ids, protos, loss_sum, seen) in zip(clients, outcomes, strict=True)]

    def train_with_prototypes(self, client: ClientState, loss_fn: Callable[[Batch], torch.Tensor],
                              generator: torch.Generator
                              ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """``run_local_training`` with ``loss_fn``, and the client's prototypes taken as
        ``options.proto_from`` says (before, during or after the update). Returns (class ids,
        prototypes, loss sum, samples)."""
        return self.prototypes_around([client], lambda on_batch: [run_local_training(
            client, self.context, loss_fn, generator, on_batch=on_batch)])[0]

    def prototypes_around(self, clients: list[ClientState],
                          train: Callable[[Callable[[Batch], None] | None], list[tuple[float, int]]]
                          ) -> list[tuple[torch.Tensor, torch.Tensor, float, int]]:
        """Run ``train(on_batch)`` (one client's loop, or a group's batched one; (loss sum,
        samples) per client) and take each client's prototypes as ``options.proto_from`` says:
        before the update, from the batches it trained on (``on_batch``, padding left out), or
        after. Returns (class ids, prototypes, loss sum, samples) per client."""
        num_classes = self.context.num_classes
        source = self.options.proto_from
        views, silent = self.prototype_views(clients)
        pre_update = [class_prototypes(c, num_classes) for c in views] if source == "pre_update" else None
        seen_features = GroupClassMeans(len(clients), num_classes, self.context.feature_dim, clients[0].device) \
            if source == "during_training" else None
        on_batch = (lambda batch: seen_features.add(batch.features, batch.labels, batch.weights)) \
            if seen_features else None
        totals = train(on_batch)
        if pre_update is not None:
            rows = pre_update
        elif seen_features is not None:
            rows = seen_features.rows()
        else:
            rows = [class_prototypes(view, num_classes) for view in views]
        rows = [(ids[:0], protos[:0]) if empty else (ids, protos)
                for (ids, protos), empty in zip(rows, silent, strict=True)]
        return [(*row, *total) for row, total in zip(rows, totals, strict=True)]

    def prototype_views(self, clients: list[ClientState]) -> tuple[list[ClientState], list[bool]]:
        """The clients as the uploaded means see them, and which upload nothing: themselves, or
        with ``proto_samples=full_batches`` views of their first full batches (the same model;
        a client without one full batch uploads nothing, as the reference's empty loader gives
        nothing). Training always sees every sample. Options not built on ``PrototypeOptions``
        (FedSA, FPL: their references take the means over every sample or during training) have
        no such choice: all samples."""
        if not isinstance(self.options, PrototypeOptions) or self.options.proto_samples == "all":
            return clients, [False] * len(clients)
        batch = self.context.train.batch_size
        kept = [client.train_y.shape[0] // batch * batch for client in clients]
        views = [dataclasses.replace(client, train_x=client.train_x[:n], train_y=client.train_y[:n]) if n else client
                 for client, n in zip(clients, kept, strict=True)]
        return views, [n == 0 for n in kept]

    def make_upload(self, client: ClientState, class_ids: torch.Tensor, protos: torch.Tensor) -> Payload:
        return {"class_ids": class_ids, "protos": protos}

    def theory_upload_floats(self, client: ClientState) -> int:
        """K·|C_i| (paper Table 5)."""
        return self.context.feature_dim * int(client.classes.numel())

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        class_ids, protos = knowledge["class_ids"], knowledge["protos"]
        if class_ids.numel() == 0:
            return torch.full((features.shape[0],), -1, dtype=torch.int64, device=features.device)
        distances = euclidean_distances(features, protos.to(features.device))
        return class_ids.to(features.device)[distances.argmin(dim=1)]


class FedProtoClient(PrototypeClient):
    trains_concurrently = True  # its upload adds class counts, made per call

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        counts = (Field("counts", torch.int64, max_rows=context.num_classes),) if context.options.weighted else ()
        return prototype_fields(context) + counts

    def make_upload(self, client: ClientState, class_ids: torch.Tensor, protos: torch.Tensor) -> Payload:
        upload = super().make_upload(client, class_ids, protos)
        if self.options.weighted:
            counts = torch.bincount(client.train_y.cpu(), minlength=self.context.num_classes)
            upload["counts"] = counts[class_ids]
        return upload


class FedProtoServer(ClassMeanServer):
    """P̄^c = mean of the uploaded P_i^c (weighted by class counts with ``weighted``); classes
    nobody uploaded are absent."""

    key = "protos"

    @classmethod
    def row_width(cls, context: AlgorithmContext) -> int:
        return context.feature_dim

    @classmethod
    def row_weights(cls, context: AlgorithmContext, upload: Payload) -> torch.Tensor | None:
        return upload["counts"] if context.options.weighted else None

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        super().validate_upload(client_id, upload)
        if self.options.weighted:
            check_class_counts(client_id, upload["class_ids"], upload["counts"])

    def diagnostics(self, uploads: dict[int, Payload], previous: Payload) -> dict[str, float]:
        return global_prototype_diagnostics(uploads, self.context.num_classes, self.download(), previous)


register_algorithm("fedproto", server=FedProtoServer, client=FedProtoClient, options=FedProtoOptions,
                   summary="per-class mean of client prototypes (Tan et al. 2022)", private_release=True,
                   conformance=ConformanceHints(
                       ranks_checked_in="tests/e2e/test_runs.py, on 4 torchrun ranks and 3 mpirun ranks"))
