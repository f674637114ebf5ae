"""What one registered architecture is: its builder's shape, the inputs it takes, its head and
its own options (``model.options.*``).

Kept apart from :mod:`htfl_dist.models.registry` (which re-exports :class:`InputNeed` and
:data:`SQUARE_IMAGES`) so the registry holds names and groups, and this module what a name stands for.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from htfl_dist.config import build_section, check_bounds

from .base import SplitModel
from .inputs import InputKind, InputSpec

OPTIONS_PREFIX = "model.options."
"""How error lines name an architecture's option (``model.options.hidden``)."""


class ArchitectureBuilder(Protocol):
    """A builder of square-picture models takes the four keyword arguments of :func:`build_model`
    (``num_classes``, ``feature_dim``, ``in_channels``, ``image_size``) and returns a model.

    Builders must draw all randomness from torch's global RNG and must not seed it: the
    caller seeds it per (seed, client_id) so construction is reproducible and independent of
    which rank builds the client. They are only called with inputs their :class:`InputNeed`
    accepts.
    """

    def __call__(self, *, num_classes: int, feature_dim: int, in_channels: int, image_size: int) -> SplitModel: ...


class InputBuilder(Protocol):
    """A builder for any other input (sensor windows, text, tabular rows) takes the data's
    :class:`InputSpec` in place of ``in_channels`` and ``image_size``; same RNG rules."""

    def __call__(self, *, num_classes: int, feature_dim: int, inputs: InputSpec) -> SplitModel: ...


class ArchitectureBuilderWithOptions(Protocol):
    """An :class:`ArchitectureBuilder` of an architecture registered with ``options=``: it also
    receives ``options``, that dataclass built from ``model.options``."""

    def __call__(self, *, num_classes: int, feature_dim: int, in_channels: int, image_size: int,
                 options: Any) -> SplitModel: ...


class InputBuilderWithOptions(Protocol):
    """An :class:`InputBuilder` of an architecture registered with ``options=`` (see above)."""

    def __call__(self, *, num_classes: int, feature_dim: int, inputs: InputSpec, options: Any) -> SplitModel: ...


AnyBuilder = ArchitectureBuilder | InputBuilder | ArchitectureBuilderWithOptions | InputBuilderWithOptions
Builder = TypeVar("Builder", bound=AnyBuilder)


@dataclass(frozen=True)
class InputNeed:
    """The inputs an architecture accepts: a kind, and for images optionally a channel count
    (HtFLlib's HARCNN family is written for nine sensor channels) or square pictures."""

    kind: InputKind
    what: str
    """How error lines name it ('square images (C x S x S)')."""
    channels: int | None = None
    square: bool = False

    def fits(self, inputs: InputSpec) -> bool:
        if inputs.kind != self.kind:
            return False
        if self.channels is not None and inputs.shape[0] != self.channels:
            return False
        return not self.square or inputs.square


SQUARE_IMAGES = InputNeed("image", "square images (C x S x S)", square=True)
"""What the image architectures take (the default of :func:`register_architecture`)."""


@dataclass(frozen=True)
class Architecture:
    """One registered architecture: its builder, what it takes, the head its builder attaches and
    its options dataclass (None: it takes none, and its builder is called without ``options``)."""

    builder: AnyBuilder
    needs: InputNeed
    head: str
    options: type | None = None

    def __post_init__(self) -> None:
        if self.options is not None and not (isinstance(self.options, type) and dataclasses.is_dataclass(self.options)):
            raise TypeError(f"an architecture's options must be a dataclass, got {self.options!r}")

    def option_names(self) -> tuple[str, ...]:
        """The ``model.options`` keys this architecture declares (none without an options dataclass)."""
        return () if self.options is None else tuple(field.name for field in dataclasses.fields(self.options))

    def build_options(self, raw: Mapping[str, Any]) -> Any:
        """The options dataclass from the keys of ``raw`` it declares (the group's other members'
        keys are theirs, not errors here: :func:`~htfl_dist.models.options.spelled_out_model_options`
        refuses keys nobody declares), checked as ``algo.*`` is: types, bounds, ``validate``.
        None for an architecture without options."""
        if self.options is None:
            return None
        declared = set(self.option_names())
        options = build_section(self.options, {key: value for key, value in raw.items() if key in declared},
                                OPTIONS_PREFIX)
        check_bounds(options, OPTIONS_PREFIX)
        validate = getattr(options, "validate", None)
        if validate is not None:
            validate()
        return options
