"""``algo.compat``: one knob, one name, for every method whose reference code departs from its
paper. ``paper`` keeps the paper's settings; ``reference`` sets every knob the user left unset to
the reference code's value at once (each method's ``validate`` says which, with the file and
commit). A knob set explicitly always wins, so a preset is never a hidden override. The default is
``paper``, except where the paper's method could not be read and only the code could (FedHKD,
FedNH: issue 47, a method's defaults follow one source). FedPCL, whose two sources are both codes
and whose paper could not be read, names them instead: ``compat: pfllib | official``
(``fedpcl.FedPCLOptions``), the same key for the same concept.

The value ``reference`` was spelled ``htfllib`` until 2026-11-29 (for most methods the reference
code is HtFLlib's); it is hashed under that old spelling, so runs made before keep their hash
and resume.
"""
from __future__ import annotations

from typing import Any, Literal

from htfl_dist.config.rules import Identity, declared

Compat = Literal["paper", "reference"]

_HASHED_AS_BEFORE = (("reference", "htfllib"),)


def compat_option(*, added_later: bool = False, default: Compat = "paper") -> Any:
    """The ``compat`` field of an options dataclass. ``added_later``: the method had options before
    it had a preset, so at ``paper`` (what its runs computed then) the key is left out of the hash
    and those runs keep their hash. ``default``: the source a method's defaults follow (issue 47:
    ``reference`` where only the code could be read). The key is still left out at ``paper``,
    not at the new default: a run at ``reference`` hashes ``htfllib`` as an explicit reference run
    always did, and a config that sets nothing no longer hashes as a paper run (it computes
    another experiment now)."""
    return declared(default, identity=Identity(added_later=added_later, before="paper",
                                               hashed_values=_HASHED_AS_BEFORE))
