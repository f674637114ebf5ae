"""The shared ("meme") model G of FML and FedKD: a model beside every client's own, one
architecture for all, trained by each client and merged by the server.

One architecture for every client: ``algo.shared_model`` (a group member, ``ARCH`` or
``ARCH:HEAD``), by default **client 0's member** (HtFLlib's rule; the FedTGP appendix says "the
smallest model", which agrees only when client 0 holds it: on HtCNN8 the rule gives htcnn1, not
the smaller htcnn2). G is built from torch's RNG seeded by (seed, "shared-model") inside a forked
RNG, so the server and every client build the identical initial G and nobody's stream moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from htfl_dist.algorithms.blocks.model_part import ModelPart, PartAveragingServer
from htfl_dist.algorithms.interface import AlgorithmContext
from htfl_dist.errors import ConfigError
from htfl_dist.models import (
    SplitModel,
    architecture_for_client,
    architectures,
    build_model,
    heads,
    model_groups,
    split_architecture,
)
from htfl_dist.seeding import seed_global_torch

CLIP_NORM = 10.0
"""FML's and FedKD's reference code clip every model's gradient norm to 10 before each step."""


def clip_gradients(module: torch.nn.Module, max_norm: float = CLIP_NORM) -> None:
    torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


def check_member_name(value: str | None) -> None:
    """``algo.shared_model`` must name one registered ARCH or ARCH:HEAD (not a group)."""
    if value is None:
        return
    if value in model_groups() or "," in value:
        raise ConfigError(f"config key 'algo.shared_model' is {value!r}, a model group; name one architecture "
                          f"(ARCH or ARCH:HEAD), e.g. htcnn2 or cnn:fc")
    arch, head = split_architecture(value)
    if arch not in architectures():
        raise ConfigError(f"config key 'algo.shared_model' is {value!r}: unknown architecture {arch!r}; "
                          f"allowed: {', '.join(architectures())} (optionally ARCH:HEAD)")
    if head not in heads():
        raise ConfigError(f"config key 'algo.shared_model' is {value!r}: unknown head {head!r}; "
                          f"allowed heads: {', '.join(heads())}")


def shared_member(context: AlgorithmContext) -> str:
    """``algo.shared_model`` or, unset, client 0's group member (HtFLlib)."""
    chosen = getattr(context.options, "shared_model", None)
    return chosen if chosen else architecture_for_client(context.model_group, 0)


def _build(context: AlgorithmContext, member: str) -> SplitModel:
    return build_model(member, num_classes=context.num_classes, feature_dim=context.feature_dim,
                       inputs=context.inputs, options=context.model_options)


def build_shared_model(context: AlgorithmContext) -> SplitModel:
    """The initial G on the CPU: identical wherever it is built, and the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        seed_global_torch(context.seed, "shared-model")
        return _build(context, shared_member(context))


def shared_model_template(context: AlgorithmContext) -> SplitModel:
    """G on the meta device: its parameter names and shapes, no memory, no RNG draws."""
    with torch.device("meta"):
        return _build(context, shared_member(context))


def parameter_shapes(context: AlgorithmContext) -> list[tuple[int, ...]]:
    """Shapes of G's parameters in ``parameters()`` order."""
    return [tuple(p.shape) for p in shared_model_template(context).parameters()]


@torch.no_grad()
def check_shared_model(context: AlgorithmContext, algorithm: str) -> None:
    """One-line ConfigError naming ``algo.shared_model`` unless G can be built, takes one input of
    the data's shape, gives K-wide features (FedKD's W_h is K×K; FML's G shares the data) and
    C-wide logits. The dry pass runs in eval mode (BatchNorm cannot train on one sample)."""
    member = shared_member(context)
    shape = [1, *context.inputs.shape]
    fix = f"set algo.shared_model to an architecture that fits (default: client 0's, " \
          f"{architecture_for_client(context.model_group, 0)})"
    try:
        model = build_shared_model(context)
    except ConfigError as error:
        raise ConfigError(f"{algorithm} shared model {member} cannot be built: {error}; {fix}") from None
    model.eval()
    try:
        features = model.features(context.inputs.example(1))
        logits = model.head(features)
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{algorithm} shared model {member} cannot take input {shape[1:]} ({reason}); "
                          f"{fix}") from None
    if tuple(features.shape) != (1, context.feature_dim):
        raise ConfigError(f"{algorithm} shared model {member} gives features of shape {list(features.shape[1:])}, "
                          f"but model.feature_dim={context.feature_dim}: its features must be K-wide; {fix}")
    if tuple(logits.shape) != (1, context.num_classes):
        raise ConfigError(f"{algorithm} shared model {member} gives {list(logits.shape[1:])} logits for "
                          f"{context.num_classes} classes; {fix}")


@dataclass(frozen=True)
class SharedModelPart(ModelPart):
    """G as a model part on the wire (``shared``): built from its own seeded stream by the server
    and every client alike, so all start from the same G."""

    name: str = "shared"

    def template(self, context: AlgorithmContext) -> nn.Module:
        return shared_model_template(context)

    def initial(self, context: AlgorithmContext) -> nn.Module:
        return build_shared_model(context)

    def check(self, context: AlgorithmContext, algorithm: str) -> None:
        check_shared_model(context, algorithm)


SHARED_MODEL = SharedModelPart()


class SharedModelServer(PartAveragingServer):
    """The server of every method with a shared model G (FML, FedMRL's small model):
    G = Σ_{i∈U} w_i·G_i over parameters, w_i = 1/|U| (``algo.avg=uniform``) or n_i/Σn
    (``sample_weighted``); it starts as the seeded initial G every client also builds. A method
    whose G is another part (FedMRL's small model) sets ``part`` and nothing else."""

    part: ClassVar[ModelPart] = SHARED_MODEL
    average_option = "avg"
    counts_on_wire = False
