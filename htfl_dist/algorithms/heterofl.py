"""HeteroFL (Diao, Ding and Tarokh, ICLR 2021) and FedRolex (Alam, Liu, Yan and Zhang, NeurIPS 2022):
width-scaled sub-models of one global model (docs/width_scaled.md).

Client i's model is a member of a width-scaled family (``models.width_scaled``: ``hetero_cnn_a``..
``_e``, ``hetero_resnet18_a``..``_e``) at rate p_i, named by its model group. The server holds the
global (rate-1) model's parameters and broadcasts them as one float32 row with its round counter.
Each client takes its slice: in every hidden dimension of width W the indices
``width_slice.slice_indices(W, p_i, algo.slice, round, seed, client)``, which both sides derive, so
no index list travels. It trains its member (fresh optimizer, gradients clipped, logits of classes
it lacks masked), uploads the trained slice as one flat float32 vector and the classes it holds.
The server averages every global entry over the uploaders that hold it (``width_slice.aggregate``;
head rows only over the uploaders holding that class) and keeps entries nobody held.

``heterofl`` slices statically (the first ceil(p W) channels), ``fedrolex`` rolls a window that
moves one channel a round; ``algo.slice`` picks any of static | rolling | random for either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from htfl_dist.algorithms import parameters
from htfl_dist.algorithms.blocks import width_slice
from htfl_dist.algorithms.interface import AlgorithmContext, ClientAlgorithm, ClientState, ServerAlgorithm, TrainResult
from htfl_dist.algorithms.optimizers import build_optimizer, current_learning_rate
from htfl_dist.algorithms.registry import ConformanceHints, register_algorithm
from htfl_dist.algorithms.training import gradient_clipper, run_local_training
from htfl_dist.config import bounded
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import architecture_for_client, build_model
from htfl_dist.models.width_scaled import WidthScaledModel, architecture_name, member_of, slice_plan
from htfl_dist.payload import Field, Payload, PayloadSpec

SliceMode = Literal["static", "rolling", "random"]
HeadRows = Literal["held_classes", "all"]
RollDirection = Literal["backward", "forward"]
Indices = dict[str, list[torch.Tensor | None]]


@dataclass
class HeteroFLOptions:
    """Defaults: HeteroFL's official code (commit ea528c3); docs/width_scaled.md lists each source."""

    slice: SliceMode = "static"
    """Which global channels a member holds: static = the first ceil(p W) (HeteroFL ``fed.py``
    ``split_model``), rolling = FedRolex's moving window, random = a fresh subset per round and client."""
    roll_direction: RollDirection = "backward"
    """Where the rolling window starts at round t: backward = (-t) mod W, FedRolex's code
    (``resnet_server.py`` ``ResnetServerRoll.split_model``, ``torch.roll``); forward = t mod W."""
    label_mask: bool = True
    """Logits of classes absent from the client's data set to 0 in training and prediction
    (``config.yml`` ``control.mask: '1'``; ``models/conv.py``, ``label_split``)."""
    head_rows: HeadRows = "held_classes"
    """Head rows averaged only over the uploaders holding that class (``fed.py`` ``combine``), or all."""
    fresh_optimizer: bool = True
    """A new optimizer (``train.*``) every round, as ``Local.train`` makes one (``make_optimizer``)."""
    clip_grad_norm: float | None = bounded(1.0, at_least=0, optional=True, note="0 or null: no clipping")
    """Gradient L2 norm clipped each step (``clip_grad_norm_(model.parameters(), 1)`` in ``Local.train``)."""


@dataclass
class FedRolexOptions(HeteroFLOptions):
    """FedRolex's official code (AIoT-MLSys-Lab/FedRolex, commit 8135109) keeps HeteroFL's training
    and aggregation (``resnet_client.py``, ``resnet_server.py``) and rolls the window."""

    slice: SliceMode = "rolling"


# --------------------------------------------------------------------------- the layout


def _meta_member(context: AlgorithmContext, arch: str) -> WidthScaledModel:
    with torch.device("meta"):
        model = build_model(arch, num_classes=context.num_classes, feature_dim=context.feature_dim,
                            inputs=context.inputs, options=context.model_options)
    assert isinstance(model, WidthScaledModel)
    return model


class Layout:
    """How each client's member maps into the global model: built once from shapes (meta device)."""

    def __init__(self, context: AlgorithmContext, algorithm: str) -> None:
        self.context = context
        self.arch = [architecture_for_client(context.model_group, i) for i in range(context.num_clients)]
        found = {arch: member_of(arch) for arch in set(self.arch)}
        strangers = sorted(arch for arch, member in found.items() if member is None)
        families = sorted({member[0] for member in found.values() if member is not None})
        if strangers or len(families) != 1:
            raise ConfigError(f"{algorithm} needs every client to be a member of one width-scaled family "
                              f"(model.group=HeteroCNN-a-e, HeteroResNet18-a-e or hetero_cnn_a,...,hetero_cnn_e); "
                              f"model.group={context.model_group!r} has {strangers or families}")
        self.rates = {arch: member[1] for arch, member in found.items() if member is not None}
        global_model = _meta_member(context, architecture_name(families[0], "a"))
        self.shapes = {name: tuple(p.shape) for name, p in global_model.named_parameters()}
        self.total = sum(math.prod(shape) for shape in self.shapes.values())
        self.plans = {arch: slice_plan(global_model, _meta_member(context, arch)) for arch in self.rates}

    def rate(self, client_id: int) -> float:
        return self.rates[self.arch[client_id]]

    def indices(self, client_id: int, round_index: int) -> Indices:
        """Per global parameter, per dimension: the global indices client ``client_id`` holds in
        round ``round_index`` (None: the whole dimension)."""
        options, rate = self.context.options, self.rate(client_id)
        drawn: dict[int, torch.Tensor] = {}
        result: Indices = {}
        for name, dims in self.plans[self.arch[client_id]].items():
            result[name] = [None if width is None else drawn.setdefault(width, width_slice.slice_indices(
                width, rate, options.slice, round_index, self.context.seed, client_id,
                -1 if options.roll_direction == "backward" else 1))
                for width in dims]
        return result

    def block_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        """The shape of each parameter's held block (what the client uploads of it)."""
        rate = self.rate(client_id)
        return {name: tuple(size if width is None else width_slice.kept_width(width, rate)
                            for size, width in zip(self.shapes[name], dims, strict=True))
                for name, dims in self.plans[self.arch[client_id]].items()}

    def upload_floats(self, client_id: int) -> int:
        return sum(math.prod(shape) for shape in self.block_shapes(client_id).values())

    def unflatten(self, row: torch.Tensor, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
        """Named tensors of ``shapes`` (default: the global model's) from one flat row, in order."""
        shapes = self.shapes if shapes is None else shapes
        flat, out, offset = row.reshape(-1), {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out


def _held_part(parameter: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The leading ``shape`` block of a member's parameter: all of it, but the head's zero padding."""
    out = parameter
    for dim, size in enumerate(shape):
        out = out.narrow(dim, 0, size)
    return out


# --------------------------------------------------------------------------- the client


class HeteroFLClient(ClientAlgorithm):
    """Installs its slice of the downloaded global model, trains it, uploads the trained slice."""

    algorithm_name = "HeteroFL"

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self._layout: Layout | None = None

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            self._layout = Layout(self.context, self.algorithm_name)
        return self._layout

    @classmethod
    def check_models(cls, context: AlgorithmContext) -> None:
        Layout(context, cls.algorithm_name)

    @classmethod
    def upload_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        total = Layout(context, cls.algorithm_name).total
        return (Field("params", torch.float32, max_rows=total),
                Field("class_ids", torch.int64, max_rows=context.num_classes))

    @torch.no_grad()
    def install(self, client: ClientState, knowledge: Payload, round_index: int) -> None:
        """Copy the client's slice of the global row into its member, in place (the row is shared)."""
        layout = self.layout
        global_state = layout.unflatten(knowledge["global"])
        indices = layout.indices(client.client_id, round_index)
        for name, parameter in client.model.named_parameters():
            block = width_slice.slice_tensor(global_state[name], indices[name])
            _held_part(parameter, tuple(block.shape)).copy_(block.to(parameter.device))

    def prepare_evaluation(self, client: ClientState, knowledge: Payload) -> None:
        """The slice the client would be handed next round (``round`` = rounds aggregated so far)."""
        self.install(client, knowledge, int(knowledge["round"][0]))

    def train(self, client: ClientState, knowledge: Payload, round_index: int,
              generator: torch.Generator) -> TrainResult:
        self.install(client, knowledge, round_index)
        options = self.options
        optimizers = None
        if options.fresh_optimizer:
            optimizers = (build_optimizer(client.model.parameters(), self.context.train,
                                          lr=current_learning_rate(client)),)
        clip = gradient_clipper(client.model.parameters(), options.clip_grad_norm)
        mask = self.absent_classes(client)
        loss_sum, seen = run_local_training(
            client, self.context, lambda batch: F.cross_entropy(self.masked(batch.logits, mask), batch.labels),
            generator, optimizers=optimizers, before_step=clip)
        return TrainResult(self.make_upload(client), loss_sum, seen)

    def absent_classes(self, client: ClientState) -> torch.Tensor | None:
        """[C] True for the classes the client's training split lacks (None: ``label_mask`` off)."""
        if not self.options.label_mask:
            return None
        absent = torch.ones(self.context.num_classes, dtype=torch.bool, device=client.device)
        absent[client.classes.to(client.device)] = False
        return absent

    @staticmethod
    def masked(logits: torch.Tensor, absent: torch.Tensor | None) -> torch.Tensor:
        """The official ``out.masked_fill(label_mask == 0, 0)``: absent classes' logits set to 0."""
        return logits if absent is None else logits.masked_fill(absent, 0.0)

    @torch.no_grad()
    def make_upload(self, client: ClientState) -> Payload:
        shapes = self.layout.block_shapes(client.client_id)
        blocks = [_held_part(p, shapes[name]).reshape(-1) for name, p in client.model.named_parameters()]
        return {"params": torch.cat(blocks).float().cpu(), "class_ids": client.classes.cpu().long()}

    def predict(self, client: ClientState, knowledge: Payload, features: torch.Tensor,
                logits: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The official local accuracy: argmax of the masked logits."""
        return self.masked(logits, self.absent_classes(client)).argmax(dim=1)

    def replaced_by_download(self, client: ClientState) -> frozenset[str]:
        return frozenset(name for name, _ in client.model.named_parameters())

    def theory_upload_floats(self, client: ClientState) -> int:
        """The held block of every parameter (the head's padding columns are not sent)."""
        return self.layout.upload_floats(client.client_id)


class FedRolexClient(HeteroFLClient):
    algorithm_name = "FedRolex"


# --------------------------------------------------------------------------- the server


class HeteroFLServer(ServerAlgorithm):
    """Holds the global model as a float32 [1, P] row (drawn as the rate-1 member from the RNG the
    runtime seeds for the server) and the number of rounds aggregated."""

    algorithm_name = "HeteroFL"

    @classmethod
    def download_fields(cls, context: AlgorithmContext) -> PayloadSpec:
        total = Layout(context, cls.algorithm_name).total
        return (Field("global", torch.float32, (total,), max_rows=1), Field("round", torch.int64, max_rows=1))

    def __init__(self, context: AlgorithmContext) -> None:
        super().__init__(context)
        self.layout = Layout(context, self.algorithm_name)
        family = member_of(self.layout.arch[0])
        assert family is not None
        model = build_model(architecture_name(family[0], "a"), num_classes=context.num_classes,
                            feature_dim=context.feature_dim, inputs=context.inputs, options=context.model_options)
        self.row = parameters.parameter_row(model)
        self.round = 0

    def download(self) -> Payload:
        return {"global": self.row, "round": torch.tensor([self.round], dtype=torch.int64)}

    def theory_download_floats(self) -> int:
        return self.layout.total

    def validate_upload(self, client_id: int, upload: Payload) -> None:
        expected = self.layout.upload_floats(client_id)
        if upload["params"].numel() != expected:
            raise ProtocolError(f"client {client_id} sent {upload['params'].numel()} parameters, its slice holds "
                                f"{expected}")
        classes = upload["class_ids"]
        valid = bool(((classes >= 0) & (classes < self.context.num_classes)).all())
        if classes.numel() == 0 or not valid or classes.unique().numel() != classes.numel():
            raise ProtocolError(f"client {client_id} sent class_ids={classes.tolist()}, expected distinct classes "
                                f"in [0, {self.context.num_classes})")

    def update(self, uploads: dict[int, Payload], round_index: int, generator: torch.Generator) -> dict[str, Any]:
        layout = self.layout
        held = []
        for client_id in sorted(uploads):
            blocks = layout.unflatten(uploads[client_id]["params"].float().cpu(), layout.block_shapes(client_id))
            indices = layout.indices(client_id, round_index)
            if self.options.head_rows == "held_classes":
                classes = uploads[client_id]["class_ids"].long().cpu()
                for name in ("head.weight", "head.bias"):
                    blocks[name] = blocks[name].index_select(0, classes)
                    indices[name] = [classes, *indices[name][1:]]
            held.append((blocks, indices))
        previous = self.row
        new = width_slice.aggregate(layout.unflatten(self.row), held)
        self.row = torch.cat([new[name].reshape(-1) for name in layout.shapes]).float().reshape(1, -1)
        self.round = round_index + 1
        return {"global_uploads": len(uploads), "global_change": float((self.row - previous).norm())}

    def state_dict(self) -> dict[str, Any]:
        return self.download()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.row, self.round = state["global"].float(), int(state["round"][0])


class FedRolexServer(HeteroFLServer):
    algorithm_name = "FedRolex"


_HINTS = ConformanceHints(overrides=("model.group=HeteroCNN-a-e",), ranks_covered_by="")
register_algorithm("heterofl", server=HeteroFLServer, client=HeteroFLClient, options=HeteroFLOptions,
                   summary="width-scaled sub-models, static slices averaged per entry over their holders "
                           "(Diao et al. 2021)", shares_parameters=True, conformance=_HINTS)
register_algorithm("fedrolex", server=FedRolexServer, client=FedRolexClient, options=FedRolexOptions,
                   summary="width-scaled sub-models, a rolling window of the global model's channels "
                           "(Alam et al. 2022)", shares_parameters=True,
                   conformance=ConformanceHints(overrides=_HINTS.overrides, ranks_covered_by="heterofl"))
