"""Architecture registry, model groups, and ``build_model``.

Architectures are registered with ``@register_architecture(name)`` on a builder; config strings
are only looked up here (never ``eval``-ed or found with ``getattr``), so an unknown name is one
:class:`~htfl_dist.errors.ConfigError` line listing what is allowed.

Model groups follow the papers' HtFE_X rule: client ``i`` gets ``group[i mod len(group)]``; one
architecture name is the homogeneous group of one (``model.group=resnet18``: every client is a
ResNet18, as in the FedTGP appendix's homogeneous-model table).

A group member is ``ARCH`` (the architecture with its default ``fc`` head, ``Linear(K, C)``) or
``ARCH:HEAD`` (the same extractor with a registered head from :mod:`htfl_dist.models.heads`,
e.g. ``resnet34:fc512``). Groups with heterogeneous heads (FedTGP's ``Res34-HtC4`` and
``HtFE8-HtC4``) are derived from an extractor group and the HtC4 head group, so that client ``i``
gets ``extractors[i mod E]`` and ``heads[i mod H]``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from htfl_dist.config.rules import PLUGIN_HINT
from htfl_dist.errors import ConfigError
from htfl_dist.registry import Registry

from .architecture import SQUARE_IMAGES as SQUARE_IMAGES
from .architecture import Architecture, ArchitectureBuilder, Builder, InputBuilder
from .architecture import InputNeed as InputNeed
from .base import SplitModel, check_new_name, natural_key
from .heads import DEFAULT_HEAD, HEAD_GROUPS, build_head, check_head, heads, registered_head
from .inputs import InputSpec

_PLUMBING = (__name__, "htfl_dist.models.base")
_ARCHITECTURES: Registry[Architecture] = Registry("architecture", order=natural_key, plumbing=_PLUMBING)

HEAD_SEPARATOR = ":"
"""Separates ``ARCH`` from ``HEAD`` in a group member (``resnet34:fc512``)."""

# FedTGP main text: the default heterogeneous group of extractors.
_HTFE8: tuple[str, ...] = (
    "cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
)


def with_heads(extractors: tuple[str, ...], head_names: tuple[str, ...]) -> tuple[str, ...]:
    """Pair extractors and heads so client ``i`` gets ``extractors[i mod E]:head_names[i mod H]``.

    The group has ``lcm(E, H)`` members (member ``j`` = ``extractors[j mod E]:head_names[j mod H]``);
    since E and H both divide its length, ``group[i mod lcm]`` applies both round-robin rules at once.
    """
    length = math.lcm(len(extractors), len(head_names))
    return tuple(
        f"{extractors[j % len(extractors)]}{HEAD_SEPARATOR}{head_names[j % len(head_names)]}" for j in range(length)
    )


_SHIPPED_GROUPS: dict[str, tuple[str, ...]] = {
    # FedTGP appendix Table 9: 1-channel 28x28 (Fashion-MNIST).
    "HtCNN8": ("htcnn1", "htcnn2", "htcnn3", "htcnn4", "htcnn5", "htcnn6", "htcnn7", "htcnn8"),
    "HtFE8": _HTFE8,
    "HtFE2": ("cnn", "resnet18"),
    "HtFE3": ("resnet10", "resnet18", "resnet34"),
    "HtFE4": ("cnn", "googlenet", "mobilenet_v2", "resnet18"),
    "HtFE9": (
        "resnet4", "resnet6", "resnet8", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    ),
    # FedTGP Tab. 2 / appendix: heterogeneous classifiers, alone and with heterogeneous extractors.
    "Res34-HtC4": with_heads(("resnet34",), HEAD_GROUPS["HtC4"]),
    "HtFE8-HtC4": with_heads(_HTFE8, HEAD_GROUPS["HtC4"]),
    # The same, with the heads as HtFLlib builds them (a ReLU after the last FC layer too).
    "Res34-HtC4-htfllib": with_heads(("resnet34",), HEAD_GROUPS["HtC4-htfllib"]),
    "HtFE8-HtC4-htfllib": with_heads(_HTFE8, HEAD_GROUPS["HtC4-htfllib"]),
    # HtFLlib's further image groups (its main.py, args.model_family).
    "HtFE5": ("googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50"),
    "HtM10": (*_HTFE8, "vit_b_16", "vit_b_32"),
    # Sensor windows (PFLlib's HAR / PAMAP2): HARCNN at strides 1-3, HARCNN1, HARCNN3.
    "HtFE-sen-2": ("harcnn_s1", "harcnn_s2"),
    "HtFE-sen-3": ("harcnn_s1", "harcnn_s2", "harcnn_s3"),
    "HtFE-sen-5": ("harcnn_s1", "harcnn_s2", "harcnn_s3", "harcnn1_s1", "harcnn3_s1"),
    "HtFE-sen-8": ("harcnn_s1", "harcnn_s2", "harcnn_s3", "harcnn1_s1", "harcnn1_s2", "harcnn1_s3",
                   "harcnn3_s1", "harcnn3_s2"),
    # Text (PFLlib's AG News): transformers named transformer_h<heads>_l<layers>.
    "HtFE-txt-2": ("fasttext", "text_logreg"),
    "HtFE-txt-4": ("fasttext", "text_logreg", "lstm", "bilstm"),
    "HtFE-txt-5-1": tuple(f"transformer_h8_l{layers}" for layers in (1, 2, 4, 8, 16)),
    "HtFE-txt-5-2": tuple(f"transformer_h{heads}_l4" for heads in (1, 2, 4, 8, 16)),
    "HtFE-txt-5-3": tuple(f"transformer_h{size}_l{size}" for size in (1, 2, 4, 8, 16)),
    "HtFE-txt-6": ("fasttext", "lstm", "bilstm", "transformer_h8_l2", "text_logreg", "gru"),
    # Tabular (PFLlib's Amazon Review): AmazonMLP with these hidden widths.
    "MLPs": ("amazon_mlp", "amazon_mlp_500", "amazon_mlp_1000_500", "amazon_mlp_1000_500_200"),
    "MLP_1layer": ("amazon_mlp_200", "amazon_mlp_500"),
    "MLP_layers": ("amazon_mlp_500", "amazon_mlp_1000_500", "amazon_mlp_1000_500_200"),
}

HTFLLIB_IMAGE_GROUPS: dict[str, str] = {
    "HtFE-img-2": "HtFE2",
    "HtFE-img-3": "HtFE3",
    "HtFE-img-4": "HtFE4",
    "HtFE-img-5": "HtFE5",
    "HtFE-img-8": "HtFE8",
    "HtFE-img-9": "HtFE9",
    "HtFE-img-8-HtC-img-4": "HtFE8-HtC4-htfllib",
    "Res34-HtC-img-4": "Res34-HtC4-htfllib",
    "HtM-img-10": "HtM10",
}
"""HtFLlib's image group names and ours with the same members (its HtC-img-4 heads put a ReLU
after every FC layer, our HtC4-htfllib)."""
_SHIPPED_GROUPS.update({htfllib: _SHIPPED_GROUPS[ours] for htfllib, ours in HTFLLIB_IMAGE_GROUPS.items()})

_MODEL_GROUPS: Registry[tuple[str, ...]] = Registry("model group", "model.group", plumbing=_PLUMBING)
"""The named groups, in registration order (the shipped members are written as registered)."""
for _name, _members in _SHIPPED_GROUPS.items():
    _MODEL_GROUPS.add(_name, _members, source=__name__)


def register_model_group(name: str, members: tuple[str, ...]) -> None:
    """Register the heterogeneous group ``name``: client ``i`` gets ``members[i mod len]``, each
    ``ARCH`` or ``ARCH:HEAD`` of registered names (a plugin registers its architectures first).
    Registering a name twice, or an architecture's name as it is spelled there, is a bug."""
    check_new_name(_MODEL_GROUPS, name)
    if _ARCHITECTURES.spelling(name) == name:
        raise ValueError(f"model group name {name!r} clashes with an architecture name")
    if not members:
        raise ValueError(f"model group {name!r} has no members")
    _MODEL_GROUPS.add(name, tuple(_checked_member(member, name) for member in members))


def register_architecture(name: str, needs: InputNeed = SQUARE_IMAGES, head: str = DEFAULT_HEAD,
                          options: type | None = None) -> Callable[[Builder], Builder]:
    """Decorator registering ``builder`` under ``name``, for inputs ``needs`` accepts: an
    :class:`ArchitectureBuilder` for square pictures (the default), an :class:`InputBuilder` for
    anything else. ``head`` is the head the builder attaches (``ARCH`` alone means
    ``ARCH:head``; HtFLlib gives its ViTs a tanh head, everything else ``fc``). ``options``: a
    dataclass of the architecture's own ``model.options.*`` (declared with ``bounded`` /
    ``Literal`` like an algorithm's); the builder then also receives ``options=`` that dataclass,
    built from the run's ``model.options``, so its shape can follow the config. Registering a
    name twice is a bug."""

    def decorator(builder: Builder) -> Builder:
        check_new_name(_ARCHITECTURES, name)
        if _MODEL_GROUPS.spelling(name) == name:
            raise ValueError(f"architecture name {name!r} clashes with a model group name")
        _ARCHITECTURES.add(name, Architecture(builder, needs, head, options))
        return builder

    return decorator


def architecture_entry(arch: str) -> Architecture:
    """What the registered architecture ``arch`` (no ``:HEAD``; any case) is; one ConfigError
    line listing the allowed names otherwise."""
    return _ARCHITECTURES.get(arch)


def input_need(arch: str) -> InputNeed:
    """What architecture ``arch`` (a registered name, no ``:HEAD``) accepts as input."""
    entry = _ARCHITECTURES.find(arch)
    return SQUARE_IMAGES if entry is None else entry.needs


def architectures() -> list[str]:
    """All registered architecture (feature extractor) names, in natural order; heads: :func:`heads`."""
    return _ARCHITECTURES.names()


def model_groups() -> dict[str, tuple[str, ...]]:
    """The named heterogeneous groups, in registration order (a copy; single-architecture
    groups are implicit)."""
    return dict(_MODEL_GROUPS.items())


def split_architecture(spec: str) -> tuple[str, str]:
    """``(ARCH, HEAD)`` of a group member ``ARCH`` or ``ARCH:HEAD`` (HEAD defaults to the
    architecture's own head: ``fc`` but for the ViTs).

    Only splits; names are checked by :func:`build_model` / :func:`resolve_group`.
    """
    arch, separator, head = spec.partition(HEAD_SEPARATOR)
    return arch, head if separator else own_head(arch)


def own_head(arch: str) -> str:
    """The head ``arch``'s builder attaches (``fc`` for a name not registered)."""
    entry = _ARCHITECTURES.find(arch)
    return DEFAULT_HEAD if entry is None else entry.head


def _spelling_hint() -> str:
    """The tail every unknown-name error ends with: how ``ARCH:HEAD`` is spelled and which heads exist."""
    return f"optionally as ARCH{HEAD_SEPARATOR}HEAD with HEAD one of {', '.join(heads())}"


MEMBER_SEPARATOR = ","
"""Separates the members of a custom group (``htcnn1,htcnn2:fc512``)."""


def resolve_group(group: str) -> tuple[str, ...]:
    """The members of ``group``, written as registered: a named group, one ``ARCH`` /
    ``ARCH:HEAD`` as a group of one, or a custom group written as members separated by commas
    (``htcnn1:fc,htcnn2:fc512``, what a YAML list in ``model.group`` becomes), e.g. HtCNN8
    extractors with HtC4 heads on FMNIST.

    Names follow the one name rule (:mod:`htfl_dist.registry`: any case). Where a group and an
    architecture share a key (the group ``HtCNN8``, the architecture ``htcnn8``), the spelling as
    registered decides, and any other spelling is refused as ambiguous.

    Raises:
        ConfigError: ``group`` is neither a named group nor made of registered architectures
            (with registered heads, where members name one), or is ambiguous.
    """
    named = _MODEL_GROUPS.entry(group)
    if named is not None:
        arch = _ARCHITECTURES.spelling(group)
        if arch is None or group == named.name:
            return named.value
        if group != arch:
            raise ConfigError(f"model group {group!r} is ambiguous: the model group {named.name!r} or the "
                              f"architecture {arch!r}; write the one you mean as it is spelled there")
    members = tuple(member.strip() for member in group.split(MEMBER_SEPARATOR))
    if len(members) > 1 and not all(members):
        raise ConfigError(f"model group {group!r} has an empty member; separate ARCH[:HEAD] members by single commas")
    return tuple(_checked_member(member, group) for member in members)


def _checked_member(member: str, group: str) -> str:
    """``member`` (``ARCH`` or ``ARCH:HEAD``) written as registered; a one-line ConfigError
    unless it names registered names."""
    arch, separator, head = member.partition(HEAD_SEPARATOR)
    spelled = _ARCHITECTURES.spelling(arch)
    if spelled is None:
        if member != group:
            raise ConfigError(f"unknown architecture {arch!r} in model group {group!r}; allowed: "
                              f"{', '.join(architectures())} ({_spelling_hint()})")
        raise ConfigError(
            f"unknown model group {group!r}; allowed: {', '.join(sorted(_MODEL_GROUPS, key=natural_key))}"
            f" (or one architecture name for a homogeneous group, or several comma-separated for a custom"
            f" group: {', '.join(architectures())}; {_spelling_hint()}; {PLUGIN_HINT})"
        )
    check_head(head if separator else own_head(spelled), member)
    return f"{spelled}{HEAD_SEPARATOR}{registered_head(head)}" if separator else spelled


def architecture_for_client(group: str, client_id: int) -> str:
    """Architecture of client ``client_id``: ``group[client_id mod len(group)]`` (HtFE_X rule)."""
    if client_id < 0:
        raise ValueError(f"client_id must be >= 0, got {client_id}")
    members = resolve_group(group)
    return members[client_id % len(members)]


def members_in_use(group: str, num_clients: int) -> list[str]:
    """The distinct architectures clients 0..num_clients-1 get, sorted (fewer clients than members
    leave the later members unused)."""
    return sorted({architecture_for_client(group, client_id) for client_id in range(num_clients)})


def check_group_inputs(group: str, num_clients: int, inputs: InputSpec) -> None:
    """One-line ConfigError naming the group, its first unfit member and the data, unless every
    member clients 0..num_clients-1 get accepts ``inputs`` (text into a CNN, 3-channel pictures
    into the nine-channel HARCNN, sensor windows into a square-image model)."""
    for member in members_in_use(group, num_clients):
        arch, _ = split_architecture(member)
        needs = input_need(arch)
        if not needs.fits(inputs):
            raise ConfigError(f"model group {group!r}: member {arch} takes {needs.what}, but the data is "
                              f"{inputs.describe()}; choose a group for this data (see docs/datasets.md)")


def _check_positive(key: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


def build_model(
    arch: str,
    *,
    num_classes: int,
    feature_dim: int = 512,
    in_channels: int = 3,
    image_size: int = 32,
    inputs: InputSpec | None = None,
    options: Mapping[str, Any] | None = None,
) -> SplitModel:
    """Build a freshly initialised client model of ``arch`` (``ARCH`` or ``ARCH:HEAD``) for
    ``inputs`` (default: square pictures ``in_channels x image_size x image_size``).

    Does not seed anything: parameters come from torch's global RNG, which the caller seeds
    (per client) beforehand, so the same RNG state always gives the same parameters.

    ``ARCH:HEAD`` builds ``ARCH`` exactly as ``ARCH`` alone, then replaces its head by a fresh
    ``HEAD`` (the discarded head's RNG draws are wasted, deterministically). For the
    architecture's own head (``ARCH:fc`` for all but the ViTs) nothing is replaced, so ``ARCH:fc``
    and ``ARCH`` are bit-identical. ``model.arch`` is ``arch`` with its names as registered (any
    case finds them, :mod:`htfl_dist.registry`).

    ``options`` is ``model.options`` (spelled out by the resolution step, or None: every option
    at its default); an architecture registered with an options dataclass is built with the keys
    it declares (the group's other members' keys are ignored), any other without ``options``.

    Raises:
        ConfigError: unknown architecture or head, a non-positive size, inputs the architecture
            does not take, an image too small, or an option of the wrong type or out of bounds.
    """
    name, head = split_architecture(arch)
    found = _ARCHITECTURES.entry(name)
    if found is None:
        shown = repr(name) if name == arch else f"{name!r} (in {arch!r})"
        raise ConfigError(f"unknown architecture {shown}; allowed: {', '.join(architectures())} ({_spelling_hint()})")
    check_head(head, arch)
    name, head, builder = found.name, registered_head(head), found.value.builder  # as registered
    extra = {} if found.value.options is None else {"options": found.value.build_options(options or {})}
    _check_positive("num_classes", num_classes)
    _check_positive("feature_dim", feature_dim)
    if inputs is None:
        if in_channels == 0 and image_size == 0:  # what the runtime gives for data that is not square pictures
            raise ConfigError(f"architecture {name!r} was asked for square pictures (in_channels and image_size), "
                              f"but the data is not pictures: this part of the algorithm builds models for images only")
        _check_positive("in_channels", in_channels)
        _check_positive("image_size", image_size)
        inputs = InputSpec.image(in_channels, image_size)
    needs = input_need(name)
    if not needs.fits(inputs):
        raise ConfigError(f"architecture {name!r} takes {needs.what}, not {inputs.describe()}")
    if needs == SQUARE_IMAGES:
        # an architecture registered for SQUARE_IMAGES is an ArchitectureBuilder, any other an InputBuilder
        model = cast(ArchitectureBuilder, builder)(num_classes=num_classes, feature_dim=feature_dim,
                                                   in_channels=inputs.shape[0], image_size=inputs.shape[1], **extra)
    else:
        model = cast(InputBuilder, builder)(num_classes=num_classes, feature_dim=feature_dim, inputs=inputs, **extra)
    if head != own_head(name):
        model.head = build_head(head, feature_dim, num_classes)
    model.arch = f"{name}{HEAD_SEPARATOR}{head}" if HEAD_SEPARATOR in arch else name
    return model


def initial_client_model(group: str, client_id: int, seed: int, *, num_classes: int, feature_dim: int,
                         in_channels: int = 3, image_size: int = 32, init: str = "per_client",
                         inputs: InputSpec | None = None, options: Mapping[str, Any] | None = None) -> SplitModel:
    """Client ``client_id``'s model as it is at the start of a run: its group member, initialised
    from torch's global RNG seeded by (seed, "init", client id) (``init="per_client"``), or seeded
    by ``seed`` alone with the default head drawn a second time (``init="htfllib"``, HtFLlib's
    ``torch.manual_seed(0)`` per client followed by BaseHeadSplit's fresh head; see
    ``model.init``). The runtime builds every client with it, and a server that starts from a
    client's initial weights (LG-FedAvg's global head is client 0's initial head) rebuilds them
    with it. ``inputs`` and ``options`` (``model.options``) as in :func:`build_model`. Reseeds the global RNG."""
    from htfl_dist.seeding import seed_global_torch

    member = architecture_for_client(group, client_id)
    if init == "htfllib":
        torch.manual_seed(seed)
    else:
        seed_global_torch(seed, "init", client_id)
    model = build_model(member, num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels,
                        image_size=image_size, inputs=inputs, options=options)
    arch, head = split_architecture(member)
    if init == "htfllib" and head == own_head(arch):
        # ARCH:HEAD already draws the architecture's own Linear and then the head, HtFLlib's order
        model.head = build_head(head, feature_dim, num_classes)
    return model
