"""The one registry type: every kind of name the engine looks up (algorithms, architectures, heads,
model groups, datasets, domain suites, generators) is a ``Registry`` with the same rules, so a
plugin's name behaves as a built-in one whatever its kind.

* **One name rule.** A name's key is its case-folded spelling (:func:`name_key`), applied when a
  name is registered and when one is looked up: ``MyFedPer`` is found as ``MyFedPer`` and as
  ``myfedper``, and is listed as it was registered. Every shipped name is lower-case but the
  model groups' (``HtCNN8``), and no two shipped names of one kind share a key.
* **A duplicate** (a second name with a registered key) is refused in one line naming where each
  was registered: the module and line of the first caller outside the registration code.
* **An unknown name** is the one line of ``config.rules.unknown_name``: the config key, the
  value, the registered names and how a plugin adds one.
* **Iteration** is in a stable order: registration order, or the kind's sort key.

It imports nothing of the package but the config layer's rules and the errors (no torch), so every
registry module can sit on it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from htfl_dist.config.rules import unknown_name
from htfl_dist.errors import ConfigError

T = TypeVar("T")


def name_key(name: str) -> str:
    """The key a name is registered and looked up under: its case-folded spelling."""
    return name.casefold()


@dataclass(frozen=True)
class Registered(Generic[T]):
    """One registration: the name as registered, what it names and where it was registered."""

    name: str
    value: T
    source: str


class Registry(Generic[T]):
    """Names of one kind → what they name, under the rules of the module docstring."""

    def __init__(self, kind: str, key: str = "", *, order: Callable[[str], Any] | None = None,
                 plumbing: tuple[str, ...] = ()) -> None:
        """``kind`` names the kind in error lines ('algorithm'); ``key`` is the config key whose
        values it holds ('algorithm', 'data.dataset'; empty where the kind's own module words the
        unknown-name line); ``order`` sorts the names (None: registration order); ``plumbing``
        names the modules whose frames are registration code, not a registration's source."""
        self.kind, self.key, self.order = kind, key, order
        self.plumbing = frozenset((__name__, *plumbing))
        self._entries: dict[str, Registered[T]] = {}

    def add(self, name: str, value: T, *, source: str | None = None) -> T:
        """Register ``value`` under ``name`` (refused as :meth:`check_free` refuses)."""
        where = self.check_free(name, source)
        self._entries[name_key(name)] = Registered(name, value, where)
        return value

    def check_free(self, name: str, source: str | None = None) -> str:
        """The source a registration of ``name`` would have; a ValueError in one line for a name
        that is not a non-empty string without surrounding blanks, or whose key is taken (naming
        both sources). A kind that checks more before it registers calls this first, so a
        duplicate is said as a duplicate."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"{self.kind} name must be a non-empty string without surrounding blanks, "
                             f"got {name!r}")
        where = source if source is not None else self._caller()
        first = self._entries.get(name_key(name))
        if first is not None:
            spelled = "" if first.name == name else f" (as {first.name!r})"
            raise ValueError(f"{self.kind} {name!r} is already registered{spelled} by {first.source}; "
                             f"{where} registers it again")
        return where

    def _caller(self) -> str:
        """``module, line N`` of the first frame outside the registration code."""
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_globals.get("__name__") in self.plumbing:
            frame = frame.f_back
        return f"{frame.f_globals.get('__name__', '?')}, line {frame.f_lineno}"

    def entry(self, name: str) -> Registered[T] | None:
        """The registration ``name`` finds under the name rule, or None."""
        return self._entries.get(name_key(name)) if isinstance(name, str) else None

    def find(self, name: str) -> T | None:
        """What ``name`` names, or None (for a kind whose module words its own unknown-name line)."""
        found = self.entry(name)
        return None if found is None else found.value

    def spelling(self, name: str) -> str | None:
        """``name`` as it was registered, or None."""
        found = self.entry(name)
        return None if found is None else found.name

    def get(self, name: str) -> T:
        """What ``name`` names; the one unknown-name line (a ConfigError) where nothing does."""
        found = self.entry(name)
        if found is None:
            raise self.unknown(name)
        return found.value

    def unknown(self, name: Any, key: str = "") -> ConfigError:
        """The one line refusing ``name`` for config key ``key`` (default: the registry's)."""
        return unknown_name(key or self.key or self.kind, name, self.names())

    def names(self) -> list[str]:
        """Every name as registered, in the registry's order."""
        spelled = [entry.name for entry in self._entries.values()]
        return spelled if self.order is None else sorted(spelled, key=self.order)

    def items(self) -> list[tuple[str, T]]:
        """(name, value) of every registration, in the registry's order."""
        return [(name, self._entries[name_key(name)].value) for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name_key(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def copy(self) -> Registry[T]:
        """A registry holding the same registrations, which later ones do not reach (tests)."""
        twin: Registry[T] = Registry(self.kind, self.key, order=self.order, plumbing=tuple(self.plumbing))
        twin._entries = dict(self._entries)
        return twin
