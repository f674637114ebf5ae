"""Architecture registry, model groups, and ``build_model``.

Architectures are registered by decorating a builder function with
``@register_architecture(name)``; config strings are only ever looked up in this registry
(never ``eval``-ed, never resolved with ``getattr`` on a library), so an unknown name is a
clean :class:`~htfl_dist.errors.ConfigError` that lists what is allowed.

Model groups follow the papers' HtFE_X rule: client ``i`` gets ``group[i mod len(group)]``.
A single architecture name is also accepted wherever a group is expected and means the
homogeneous group of one (``model.group=resnet18`` -> every client is a ResNet18, as in the
FedTGP appendix's homogeneous-model table).
"""
from __future__ import annotations

import re
from typing import Callable, Protocol

from htfl_dist.errors import ConfigError

from .base import SplitModel


class ArchitectureBuilder(Protocol):
    """A builder takes the four keyword arguments of :func:`build_model` and returns a model.

    Builders must draw all randomness from torch's global RNG and must not seed it: the
    caller seeds it per (seed, client_id) so construction is reproducible and independent of
    which rank builds the client.
    """

    def __call__(self, *, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel: ...


_ARCHITECTURES: dict[str, ArchitectureBuilder] = {}

_MODEL_GROUPS: dict[str, tuple[str, ...]] = {
    # FedTGP appendix Table 9: 1-channel 28x28 (Fashion-MNIST).
    "HtCNN8": ("htcnn1", "htcnn2", "htcnn3", "htcnn4", "htcnn5", "htcnn6", "htcnn7", "htcnn8"),
    # FedTGP main text: the default heterogeneous group.
    "HtFE8": (
        "cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    ),
    "HtFE2": ("cnn", "resnet18"),
    "HtFE3": ("resnet10", "resnet18", "resnet34"),
    "HtFE4": ("cnn", "googlenet", "mobilenet_v2", "resnet18"),
    "HtFE9": (
        "resnet4", "resnet6", "resnet8", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    ),
}


def _natural_key(name: str) -> list[object]:
    """Sort key that orders ``resnet4 < resnet10 < resnet18`` (digits compared as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def register_architecture(name: str) -> Callable[[ArchitectureBuilder], ArchitectureBuilder]:
    """Decorator registering ``builder`` under ``name``. Registering a name twice is a bug."""

    def decorator(builder: ArchitectureBuilder) -> ArchitectureBuilder:
        if name in _ARCHITECTURES:
            raise ValueError(f"architecture {name!r} is already registered")
        if name in _MODEL_GROUPS:
            raise ValueError(f"architecture name {name!r} clashes with a model group name")
        _ARCHITECTURES[name] = builder
        return builder

    return decorator


def architectures() -> list[str]:
    """All registered architecture names, in natural order."""
    return sorted(_ARCHITECTURES, key=_natural_key)


def model_groups() -> dict[str, tuple[str, ...]]:
    """The named heterogeneous groups (a copy; single-architecture groups are implicit)."""
    return dict(_MODEL_GROUPS)


def resolve_group(group: str) -> tuple[str, ...]:
    """The architectures of ``group``: a named group, or one architecture name as a group of one.

    Raises:
        ConfigError: ``group`` is neither a named group nor a registered architecture.
    """
    if group in _MODEL_GROUPS:
        return _MODEL_GROUPS[group]
    if group in _ARCHITECTURES:
        return (group,)
    raise ConfigError(
        f"unknown model group {group!r}; allowed: {', '.join(sorted(_MODEL_GROUPS, key=_natural_key))}"
        f" (or one architecture name for a homogeneous group: {', '.join(architectures())})"
    )


def architecture_for_client(group: str, client_id: int) -> str:
    """Architecture of client ``client_id``: ``group[client_id mod len(group)]`` (HtFE_X rule)."""
    if client_id < 0:
        raise ValueError(f"client_id must be >= 0, got {client_id}")
    members = resolve_group(group)
    return members[client_id % len(members)]


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
) -> SplitModel:
    """Build a freshly initialised client model of architecture ``arch``.

    Does not seed anything: parameters come from torch's global RNG, which the caller seeds
    (per client) beforehand, so the same RNG state always gives the same parameters.

    Raises:
        ConfigError: unknown ``arch``, a non-positive size, or an image too small for ``arch``.
    """
    builder = _ARCHITECTURES.get(arch)
    if builder is None:
        raise ConfigError(f"unknown architecture {arch!r}; allowed: {', '.join(architectures())}")
    _check_positive("num_classes", num_classes)
    _check_positive("feature_dim", feature_dim)
    _check_positive("in_channels", in_channels)
    _check_positive("image_size", image_size)
    model = builder(num_classes=num_classes, feature_dim=feature_dim, in_channels=in_channels, image_size=image_size)
    model.arch = arch
    return model
