"""One block for every method that shares a piece of a model: the head (LG-FedAvg, FedGen, FedGH),
the feature extractor (FedPer-style), the whole client model (FedAvg-style), or a separate shared
model G that every client trains beside its own (FML, FedKD).

A :class:`ModelPart` says which module travels and how to build the server's starting copy of it.
It travels as one float32 row of its parameters (``parameters.parameter_row``): never a pickled
module, and the receiver loads the row into its own copy. Averaging a part is only meaningful
when every client's part has the same parameter names and shapes, so each part checks that once
at start-up and names the first client that differs.

:class:`PartSharingClient` and :class:`PartAveragingServer` are the complete FedAvg-over-a-part
pair; a variant sets ``part`` and overrides the one method it changes (its loss, its upload, its
server update), as in Flower's ``Strategy`` subclasses.
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
from htfl_dist.algorithms.presets import Compat, compat_option
from htfl_dist.algorithms.training import Batch, run_local_training
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import architecture_for_client, build_model
from htfl_dist.payload import Field, Payload, PayloadSpec

Average = Literal["sample_weighted", "uniform"]
LossFunction = Callable[[Batch], torch.Tensor]

ClientPartName = Literal["head", "feature_extractor", "model"]


def _meta_member(context: AlgorithmContext, member: str) -> nn.Module:
    """``member`` built on the meta device: parameter names and shapes, no memory, no RNG draws."""
    with torch.device("meta"):
        return build_model(member, num_classes=context.num_classes, feature_dim=context.feature_dim,
                           inputs=context.inputs, options=context.model_options)


def _describe(signature: dict[str, tuple[int, ...]]) -> str:
    return "{" + ", ".join(f"{name}:{list(shape)}" for name, shape in signature.items()) + "}"


@dataclass(frozen=True)
class ModelPart:
    """A module that travels as one parameter row under the payload name ``name``."""

    name: str
    """The payload field, the server's state key and the prefix of its diagnostics."""

    def template(self, context: AlgorithmContext) -> nn.Module:
        """The part on the meta device: what the wire row describes."""
        raise NotImplementedError

    def initial(self, context: AlgorithmContext) -> nn.Module:
        """The server's starting copy, identical to what the clients start from."""
        raise NotImplementedError

    def check(self, context: AlgorithmContext, algorithm: str) -> None:
        """One-line ConfigError unless the part can be shared in this run."""

    def field(self, context: AlgorithmContext) -> Field:
        return parameters.parameter_field(self.name, self.template(context))

    def floats(self, context: AlgorithmContext) -> int:
        return parameters.parameter_count(self.template(context))


@dataclass(frozen=True)
class ClientModelPart(ModelPart):
    """A piece of every client's own ``SplitModel``: its ``head``, its ``feature_extractor`` or the
    whole ``model``. The server starts from client 0's initial piece."""

    name: ClientPartName = "head"

    def of(self, model: nn.Module) -> nn.Module:
        return model if self.name == "model" else getattr(model, self.name)

    def template(self, context: AlgorithmContext) -> nn.Module:
        return self.of(_meta_member(context, architecture_for_client(context.model_group, 0)))

    def initial(self, context: AlgorithmContext) -> nn.Module:
        return self.of(parameters.initial_model_of(context, 0))

    def check(self, context: AlgorithmContext, algorithm: str) -> None:
        """Every client's piece has client 0's parameter names and shapes (each member built once,
        on the meta device); heterogeneous pieces (HtC4 heads, HtFE8 extractors) cannot be averaged."""
        signatures: dict[str, dict[str, tuple[int, ...]]] = {}
        first_member = architecture_for_client(context.model_group, 0)
        for client_id in range(context.num_clients):
            member = architecture_for_client(context.model_group, client_id)
            if member not in signatures:
                module = self.of(_meta_member(context, member))
                signatures[member] = {name: tuple(p.shape) for name, p in module.named_parameters()}
            if signatures[member] != signatures[first_member]:
                noun = {"head": "heads", "feature_extractor": "feature extractors", "model": "models"}[self.name]
                raise ConfigError(
                    f"{algorithm} shares the {self.name.replace('_', ' ')}, so all {noun} must be identical; "
                    f"client {client_id} ({member}) has {_describe(signatures[member])} but client 0 "
                    f"({first_member}) has {_describe(signatures[first_member])}. Use a group with homogeneous "
                    f"{noun}, or feddistill/fml/fedkd/fedproto/fedtgp.")


HEAD = ClientModelPart("head")
FEATURE_EXTRACTOR = ClientModelPart("feature_extractor")
WHOLE_MODEL = ClientModelPart("model")


class DownloadedCopy:
    """A client-side working copy of a downloaded part: its parameters from the download, its
    buffers (BatchNorm statistics) the initial part's, since only parameters travel. One module,
    refilled at every download, so a round of many clients allocates it once (FML's G_i, FedMRL's
    G under ``eval_extractor=global``)."""

    def __init__(self, part: ModelPart, context: AlgorithmContext) -> None:
        self.part, self.context = part, context
        self.module: nn.Module | None = None
        self.initial_buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def load(self, knowledge: Payload, device: torch.device) -> nn.Module:
        if self.module is None:
            self.module = self.part.initial(self.context)
            self.initial_buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        module = self.module = self.module.to(device)
        parameters.load_parameter_row(module, knowledge[self.part.name].to(device))
        for name, buffer in module.named_buffers():
            buffer.copy_(self.initial_buffers[name])
        return module


def sample_count(client: ClientState) -> torch.Tensor:
    """n_i = size of the client's full training split, as int64 [1] (not counted as floats)."""
    return torch.tensor([client.train_y.shape[0]], dtype=torch.int64)


SAMPLE_COUNT = Field("num_samples", torch.int64, max_rows=1)


def part_upload_fields(part: ModelPart, context: AlgorithmContext, average: Average) -> PayloadSpec:
    """A trained part's row, plus n_i only when the server weights by it (``counts_on_wire=False``
    on the server: FML's and FedMRL's shared model)."""
    return (part.field(context), *((SAMPLE_COUNT,) if average == "sample_weighted" else ()))


def part_upload(part: ModelPart, module: nn.Module, client: ClientState, average: Average) -> Payload:
    """The upload ``part_upload_fields`` declares, for ``module`` trained by ``client``."""
    upload = {part.name: parameters.parameter_row(module)}
    if average == "sample_weighted":
        upload["num_samples"] = sample_count(client)
    return upload


@dataclass
class HeadSharingOptions:
    """Options every head-sharing method has."""

    compat: Compat = compat_option()
    """reference: every knob left unset takes HtFLlib HEAD's value (each variant lists which)."""


@dataclass
class HeadAveragingOptions(HeadSharingOptions):
    """Options of the methods whose server averages the uploaded heads (LG-FedAvg, FedGen)."""

    head_avg: Average = "sample_weighted"
    """How the server averages the uploaded heads: sample_weighted = Σ_i (n_i/Σn)·h_i (HtFLlib,
    default and ``compat: reference``); uniform = the plain mean over the uploaders (official
    LG-FedAvg ``main_lg.py``)."""


class PartSharingClient(ClientAlgorithm):
    """Round start: the downloaded part replaces the client's own (before evaluation too, so the
    metric is the fresh global part on the local rest). Train the whole model with CE (plus a
    variant's term), upload the trained part and n_i."""

    part: ClassVar[ClientModelPart] = HEAD
    algorithm_name: ClassVar[str] = "a model-part sharing algorithm"
    """Named in the identical-part error."""

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self._part_floats: int | None = None

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        cls.part.check(context, cls.algorithm_name)

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (cls.part.field(context), SAMPLE_COUNT)

    def install(self, client: ClientState, knowledge: Payload) -> None:
        """Copy the downloaded row into the client's part in place (the row is shared by every
        client of this rank and must not change)."""
        parameters.load_parameter_row(self.part.of(client.model), knowledge[self.part.name])

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        self.install(client, knowledge)

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        self.install(client, knowledge)
        loss_fn = self.loss_function(client, knowledge, round_index)
        loss_sum, seen = run_local_training(client, self.context, loss_fn, generator)
        return TrainResult(self.make_upload(client), loss_sum, seen)

    def loss_function(self, client: ClientState, knowledge: Payload, round_index: int) -> LossFunction:
        """The round's objective on one batch (CE; FedGen adds its generator term)."""
        return lambda batch: F.cross_entropy(batch.logits, batch.labels)

    def make_upload(self, client: ClientState) -> Payload:
        return {self.part.name: parameters.parameter_row(self.part.of(client.model)),
                "num_samples": sample_count(client)}

    def replaced_by_download(self, client: ClientState) -> frozenset[str]:
        """The part's parameters: ``train`` and ``prepare_evaluation`` install the download first."""
        prefix = "" if self.part.name == "model" else f"{self.part.name}."
        return frozenset(prefix + name for name, _ in self.part.of(client.model).named_parameters())

    def theory_upload_floats(self, client: ClientState) -> int:
        """The part's parameters (n_i is an integer and not counted); counted once, as every
        client's part has client 0's shapes (``check_models``): counting builds the part on the
        meta device, 5 ms a client for pfl's CNN."""
        if self._part_floats is None:
            self._part_floats = self.part.floats(self.context)
        return self._part_floats


class PartServer(ServerAlgorithm):
    """Holds the global part (``module`` on the context's device, ``row`` its float32 [1, P] copy on
    the CPU) starting from ``part.initial`` and downloads it. Variants decide how it changes."""

    part: ClassVar[ModelPart] = HEAD

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        return (cls.part.field(context),)

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.device = context.device
        self.module = self.part.initial(context).to(context.device)
        self.row = parameters.parameter_row(self.module)

    def download(self) -> Payload:
        return {self.part.name: self.row}

    def theory_download_floats(self) -> int:
        return self.row.shape[1]

    def set_row(self, row: torch.Tensor) -> None:
        self.row = row.float().cpu()
        parameters.load_parameter_row(self.module, self.row.to(self.device))

    def state_dict(self) -> dict[str, Any]:
        return {self.part.name: self.row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_row(state[self.part.name])


class PartAveragingServer(PartServer):
    """part = Σ_{i∈U} w_i · part_i over the uploads, in client-id order; w_i = n_i / Σ_{j∈U} n_j
    (sample_weighted) or 1/|U| (uniform), as the option named by ``average_option`` says."""

    average_option: ClassVar[str] = "head_avg"
    counts_on_wire: ClassVar[bool] = True
    """Whether uploads carry ``num_samples`` whatever the weighting (LG-FedAvg's do); otherwise
    only when weighting by it (FML)."""

    def average(self) -> Average:
        return getattr(self.options, self.average_option)

    def expects_counts(self) -> bool:
        return self.counts_on_wire or self.average() == "sample_weighted"

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        rows = upload[self.part.name].shape[0]
        if rows != 1:
            raise ProtocolError(f"client {client_id} sent {rows} {self.part.name} rows, expected 1")
        if self.expects_counts():
            counts = upload["num_samples"]
            if counts.shape[0] != 1 or int(counts[0]) <= 0:
                raise ProtocolError(f"client {client_id} sent num_samples={counts.tolist()}, expected one count > 0")

    def sample_weights(self, uploads: dict[int, Payload]) -> list[float]:
        """n_i of the uploaders, in client-id order."""
        return [float(uploads[client_id]["num_samples"][0]) for client_id in sorted(uploads)]

    @classmethod
    def summed_fields(cls, context: AlgorithmContext) -> dict[str, tuple[int, ...]] | None:
        """Σ_i w_i·part_i [1, P] and Σ_i w_i [1]: the mean is their ratio."""
        return {cls.part.name: (1, cls.part.floats(context)), "weight": (1,)}

    @classmethod
    def contribution(cls, context: AlgorithmContext, upload: Payload) -> dict[str, torch.Tensor]:
        weighted = getattr(context.options, cls.average_option) == "sample_weighted"
        weight = float(upload["num_samples"][0]) if weighted else 1.0
        row = upload[cls.part.name].cpu()  # unweighted: the float32 row itself (x · 1.0 in float64 is x)
        return {cls.part.name: row.double() * weight if weighted else row,
                "weight": torch.tensor([weight], dtype=torch.float64)}

    def update_from_sums(self, sums: dict[str, torch.Tensor], uploaders: int, round_index: int,
                         generator: torch.Generator) -> dict[str, Any]:
        previous = self.row
        self.set_row((sums[self.part.name].double() / sums["weight"].double()).float())
        return {f"{self.part.name}_uploads": uploaders, f"{self.part.name}_change": float((self.row - previous).norm())}

    def update(self, uploads: dict[int, Payload], round_index: int,
               generator: torch.Generator) -> dict[str, Any]:
        rows = [uploads[client_id][self.part.name].float().cpu() for client_id in sorted(uploads)]
        weights = self.sample_weights(uploads) if self.average() == "sample_weighted" else None
        previous = self.row
        self.set_row(parameters.average_rows(rows, weights))
        return {f"{self.part.name}_uploads": len(uploads),
                f"{self.part.name}_change": float((self.row - previous).norm())}
