"""The rules config values are held to, as one module that imports nothing of the package but its
errors: a numeric range declared next to its field (``bounded``, checked by ``check_bounds`` with
one wording everywhere, algorithm options and plugins' options included), and the one refusal of
a name that no registry holds (``unknown_name``). Everything that checks a value uses these, so a
mistake reads the same whichever layer finds it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from htfl_dist.errors import ConfigError, shown

PLUGIN_HINT = "a plugin registers more: --import MODULE, the config key plugins: [MODULE], or an installed package"


@dataclass(frozen=True)
class Bound:
    """The range a numeric config value must lie in, declared next to its field (``bounded``),
    so each section states its own limits and one loop checks them all with the same wording."""

    above: float | None = None  # value > above
    at_least: float | None = None  # value >= at_least
    below: float | None = None  # value < below
    at_most: float | None = None  # value <= at_most
    note: str = ""
    """Why the limit, or what the edge value means ("0 = never"), shown in the message."""
    optional: bool = False
    """None is allowed (it means the note's default)."""

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.optional
        return ((self.above is None or value > self.above) and (self.at_least is None or value >= self.at_least)
                and (self.below is None or value < self.below) and (self.at_most is None or value <= self.at_most))

    def describe(self) -> str:
        low = (f"({_number(self.above)}" if self.above is not None
               else f"[{_number(self.at_least)}" if self.at_least is not None else None)
        high = (f"{_number(self.below)})" if self.below is not None
                else f"{_number(self.at_most)}]" if self.at_most is not None else None)
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"{'>' if low[0] == '(' else '>='} {low[1:]}"
        else:
            assert high is not None, "a Bound declares at least one limit"
            text = f"{'<' if high[-1] == ')' else '<='} {high[:-1]}"
        return f"{text} ({self.note})" if self.note else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


class TheDefault:
    """The marker of :attr:`Identity.before` left unset: the field's default is what runs made
    before the key computed (compared by type, so it survives a pickle)."""

    def __repr__(self) -> str:
        return "THE_DEFAULT"


THE_DEFAULT: Any = TheDefault()


@dataclass(frozen=True)
class Identity:
    """How a field enters the experiment's identity (``config.identity``), declared next to the
    field so that adding a key says, where it is added, whether old runs keep their hash: the
    hash walks these declarations instead of lists kept by hand elsewhere."""

    plumbing: bool = False
    """Not part of the experiment (where output goes, when to give up, where data lives)."""
    added_later: bool = False
    """Added after runs existed: at its default (the only behaviour before it), left out of the
    hash, so those runs and their checkpoints keep their hash."""
    before: Any = THE_DEFAULT
    """With ``added_later``, once the default has changed since the key was added: the value that
    computes what the runs made before it did. Left out of the hash at this value instead of at
    the default (those runs keep their hash; a run at the new default is another experiment), and
    a stored experiment without the key reads as this value (``identity.stored_options``), so a
    checkpoint made before is never compared as if it had run the new default."""
    location: bool = False
    """Where files live: hashed as ``True`` when set (that they are used is the experiment; where
    they are is not; their bytes are checked against the checkpoint's instead)."""
    hashed_as: str | None = None
    """The key's name in the hash when it was renamed: runs made under the old name keep their hash."""
    hashed_values: tuple[tuple[Any, Any], ...] = ()
    """(value, value in the hash) pairs for a value renamed, for the same reason."""
    omit_when_default: bool = False
    """A section left out of the hash when its view equals its default's (it changes nothing)."""
    omit_unless: tuple[str, ...] = ()
    """A section left out of the hash unless one of these boolean keys of it is true (off, it changes nothing)."""


PLUMBING = Identity(plumbing=True)
ADDED_LATER = Identity(added_later=True)
LOCATION = Identity(location=True)


def declared(default: Any = dataclasses.MISSING, *, identity: Identity | None = None,
             default_factory: Any = dataclasses.MISSING, **limits: Any) -> Any:
    """A dataclass field with its rules declared beside it: a :class:`Bound` when ``limits`` are
    given (checked by ``check_bounds``) and an :class:`Identity` (walked by ``config.identity``)."""
    metadata: dict[str, Any] = {}
    if limits:
        metadata["bound"] = Bound(**limits)
    if identity is not None:
        metadata["identity"] = identity
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def bounded(default: Any, *, identity: Identity | None = None, **limits: Any) -> Any:
    """A dataclass field with a :class:`Bound` (see ``check_bounds``) and optionally an :class:`Identity`."""
    return declared(default, identity=identity, **limits)


def check_bounds(section: Any, prefix: str = "") -> None:
    """One line for the first field of ``section`` (and its sub-sections) out of its bound."""
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{prefix}{item.name}.")
            continue
        bound = item.metadata.get("bound")
        if bound is not None:
            _check(f"{prefix}{item.name}", value, bound)


def check_value(key: str, value: Any, **limits: Any) -> None:
    """The check ``bounded`` declares, for a value that reaches a function by another road than a
    loaded config (a library call, a partition built in a test): the same line as ``check_bounds``."""
    _check(key, value, Bound(**limits))


def _check(key: str, value: Any, bound: Bound) -> None:
    if not bound.holds(value):
        raise ConfigError(f"config key '{key}' must be {bound.describe()}, got {shown(value)}")


def unknown_name(key: str, value: Any, allowed: Iterable[str], what: str = "registered") -> ConfigError:
    """The one line for a registry-named key whose value no registry holds: the key, the value,
    what is registered now and how a plugin adds to it."""
    return ConfigError(f"config key '{key}' is {shown(value)}; {what}: {', '.join(allowed) or 'none'} "
                       f"({PLUGIN_HINT})")
