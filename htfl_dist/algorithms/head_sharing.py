"""What the head-sharing baselines (LG-FedAvg, FedGH, FedGen) have in common, as the baselines
spec §0, §2–4 describe it.

Every client's model is its own feature extractor f_i plus a head h_i of one shape for all
clients (checked at start-up: heterogeneous heads, e.g. HtC4, cannot be averaged). Each round
the server's global head goes to every client and replaces its head, before evaluation (so the
metric is the fresh global head on the local base) and before training. A participant trains
the whole model with cross-entropy (a variant adds a term via :meth:`HeadSharingClient.loss_function`)
and uploads what its variant uploads: the trained head and its sample count (LG-FedAvg, FedGen)
or class prototypes (FedGH).

The server's global head starts as **client 0's initial head**, so in round 0 every client
already carries client 0's head. :class:`HeadAveragingServer` replaces it by the
sample-weighted (or uniform) mean of the uploaded heads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.interface import (
    AlgorithmContext,
    ClientAlgorithm,
    ClientState,
    ServerAlgorithm,
    TrainResult,
)
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import architecture_for_client, build_head, split_architecture
from htfl_dist.payload import Field, Payload, PayloadSpec

HeadAverage = Literal["sample_weighted", "uniform"]
LossFunction = Callable[[Batch], torch.Tensor]


@dataclass
class HeadSharingOptions:
    """Options every head-sharing baseline has."""

    compat: Literal["paper", "htfllib"] = "paper"
    """htfllib: every knob left unset takes HtFLlib HEAD's value (each variant lists which)."""

    def validate(self) -> None:
        """Literal values are checked by the config loader; variants resolve their ``None`` knobs."""


@dataclass
class HeadAveragingOptions(HeadSharingOptions):
    """Options of the methods whose server averages the uploaded heads (LG-FedAvg, FedGen)."""

    head_avg: HeadAverage = "sample_weighted"
    """How the server averages the uploaded heads: sample_weighted = Σ_i (n_i/Σn)·h_i (HtFLlib,
    default and ``compat: htfllib``); uniform = the plain mean over the uploaders (official
    LG-FedAvg ``main_lg.py``)."""


def positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"config key 'algo.{key}' must be > 0, got {value}")


def at_least_one(value: int | None, key: str) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"config key 'algo.{key}' must be >= 1, got {value}")


def head_template(context: AlgorithmContext) -> nn.Module:
    """Client 0's head built on the meta device: its parameter names and shapes, no memory. All
    heads are identical (checked), so it describes every head on the wire."""
    _, head = split_architecture(architecture_for_client(context.model_group, 0))
    with torch.device("meta"):
        return build_head(head, context.feature_dim, context.num_classes)


def head_field(context: AlgorithmContext) -> Field:
    """The head's parameters as one float32 row (``head.weight``, ``head.bias`` for Linear(K, C))."""
    return parameters.parameter_field("head", head_template(context))


def head_floats(context: AlgorithmContext) -> int:
    """Floats in one head: K·C + C for the default Linear(K, C)."""
    return parameters.parameter_count(head_template(context))


def install_head(client: ClientState, knowledge: Payload) -> None:
    """Overwrite the client's head with the downloaded global head (copied in place: the
    downloaded row is shared by every client of this rank and must not change)."""
    parameters.load_parameter_row(client.model.head, knowledge["head"])


def sample_count(client: ClientState) -> torch.Tensor:
    """n_i = size of the client's full training split, as int64 [1] (not counted as floats)."""
    return torch.tensor([client.train_y.shape[0]], dtype=torch.int64)


class HeadSharingClient(ClientAlgorithm):
    """Round start: the global head replaces h_i. Train the whole model with CE (plus a variant's
    term), then upload the trained head and n_i (LG-FedAvg, FedGen; FedGH overrides the upload)."""

    algorithm_name: ClassVar[str] = "a head-sharing algorithm"
    """Named in the identical-heads error."""

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        parameters.require_identical_heads(context, cls.algorithm_name)

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (head_field(context), Field("num_samples", torch.int64, max_rows=1))

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        """Evaluation uses the freshly downloaded global head on the local base (spec §0)."""
        install_head(client, knowledge)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        install_head(client, knowledge)
        loss_fn = self.loss_function(client, knowledge, round_index)
        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator)
        return TrainResult(self.make_upload(client), loss_sum, seen)

    def loss_function(self, client: ClientState, knowledge: Payload, round_index: int) -> LossFunction:
        """The round's objective on one batch (CE; FedGen adds its generator term)."""
        return lambda batch: F.cross_entropy(batch.logits, batch.labels)

    def make_upload(self, client: ClientState) -> Payload:
        return {"head": parameters.parameter_row(client.model.head), "num_samples": sample_count(client)}

    def theory_upload_floats(self, client: ClientState) -> int:
        """K·C + C: the head's parameters (n_i is an integer and not counted)."""
        return head_floats(self.context)


class GlobalHeadServer(ServerAlgorithm):
    """Holds the global head as one parameter row, starting from client 0's initial head, and
    downloads it as ``head``. Variants decide how it changes (:meth:`update`)."""

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (head_field(context),)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.device = context.device
        self.head_module = parameters.initial_model_of(context, 0).head  # on context.device
        self.head = parameters.parameter_row(self.head_module)  # float32 [1, P] on the CPU

    def download(self) -> Payload:
        return {"head": self.head}

    def theory_download_floats(self) -> int:
        """K·C + C: the global head."""
        return head_floats(self.context)

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.head}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head = state["head"].float().cpu()
        parameters.load_parameter_row(self.head_module, self.head)


def check_head_upload(client_id: int, upload: Payload) -> None:
    """One head row and one positive sample count."""
    if upload["head"].shape[0] != 1:
        raise ProtocolError(f"client {client_id} sent {upload['head'].shape[0]} head rows, expected 1")
    counts = upload["num_samples"]
    if counts.shape[0] != 1 or int(counts[0]) <= 0:
        raise ProtocolError(f"client {client_id} sent num_samples={counts.tolist()}, expected one count > 0")


class HeadAveragingServer(GlobalHeadServer):
    """h̄ = Σ_{i∈U} w_i · h_i over the uploaded heads, in client-id order; w_i = n_i / Σ_{j∈U} n_j
    (``head_avg: sample_weighted``) or 1/|U| (``uniform``)."""

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        check_head_upload(client_id, upload)

    def sample_weights(self, uploads: dict[int, Payload]) -> list[float]:
        """n_i of the uploaders, in client-id order."""
        return [float(uploads[client_id]["num_samples"][0]) for client_id in sorted(uploads)]

    def average_heads(self, uploads: dict[int, Payload]) -> None:
        client_ids = sorted(uploads)
        rows = [uploads[client_id]["head"].float().cpu() for client_id in client_ids]
        weights = self.sample_weights(uploads) if self.options.head_avg == "sample_weighted" else None
        self.head = parameters.average_rows(rows, weights)
        parameters.load_parameter_row(self.head_module, self.head)

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        if not uploads:  # every upload screened out: keep the global head
            return {}
        previous = self.head
        self.average_heads(uploads)
        return {"head_uploads": len(uploads), "head_change": float((self.head - previous).norm())}
