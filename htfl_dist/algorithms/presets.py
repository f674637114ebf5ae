"""``algo.compat``: one knob, one name, for every method whose reference code departs from its
paper. ``paper`` (default) keeps the paper's settings; ``reference`` sets every knob the user left
unset to the reference code's value at once (each method's ``validate`` says which, with the
file and commit). A knob set explicitly always wins, so a preset is never a hidden override.

The value ``reference`` was spelled ``htfllib`` until 2026-11-29 (for most methods the reference
code is HtFLlib's); it is hashed under that old spelling, so runs made before keep their hash
and resume.
"""
from __future__ import annotations

from typing import Any, Literal

from htfl_dist.config.rules import Identity, declared

Compat = Literal["paper", "reference"]

_HASHED_AS_BEFORE = (("reference", "htfllib"),)


def compat_option(*, added_later: bool = False) -> Any:
    """The ``compat`` field of an options dataclass. ``added_later``: the method had options before
    it had a preset, so at ``paper`` the key is left out of the hash (its runs keep their hash)."""
    return declared("paper", identity=Identity(added_later=added_later, hashed_values=_HASHED_AS_BEFORE))
