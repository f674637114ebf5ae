"""``model.options``: the options the architectures of a run's model group declare, checked and
spelled out once, at resolution (``htfl_dist.resolution``), as ``algo.*`` and ``data.options``
are.

One mapping serves the whole group: each architecture registered with an options dataclass
takes the keys it declares from it (``build_model``), so a key must be declared by at least one
member, and two members declaring the same key must agree on its value (both read the one
entry; where only their defaults differ, writing the key settles it).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from htfl_dist.errors import ConfigError, clipped, shown

from .architecture import OPTIONS_PREFIX, Architecture
from .registry import architecture_entry, resolve_group, split_architecture


def group_architectures(group: str) -> dict[str, Architecture]:
    """The distinct architectures of ``group``'s members (``ARCH`` of each ``ARCH:HEAD``), as
    registered, in member order. Every member counts, used by this run's clients or not: the
    options are the group's, and a run with more clients reaches the later members."""
    found: dict[str, Architecture] = {}
    for member in resolve_group(group):
        arch = split_architecture(member)[0]
        found.setdefault(arch, architecture_entry(arch))
    return found


def spelled_out_model_options(group: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``model.options`` checked against ``group`` and with every option of its members written
    out (the union of their declared fields and values): the form a config is stored and hashed
    in, so writing a default explicitly is the same experiment. Empty where no member declares
    options, so every config without them hashes as before ``model.options`` existed.

    Raises:
        ConfigError: a key no member declares, a value an architecture refuses (type, bounds,
            ``validate``), or two members that would read one key with different values.
    """
    declaring = {arch: entry for arch, entry in group_architectures(group).items() if entry.options is not None}
    declared = {name for entry in declaring.values() for name in entry.option_names()}
    for key in raw:
        if key not in declared:
            raise ConfigError(f"unknown config key '{clipped(OPTIONS_PREFIX + str(key))}': "
                              f"{_who_declares(group, declaring)}")
    spelled: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for arch, entry in declaring.items():
        for name, value in dataclasses.asdict(entry.build_options(raw)).items():
            if name in spelled and spelled[name] != value:
                raise ConfigError(f"config key '{OPTIONS_PREFIX}{name}': architectures {owner[name]} and {arch} of "
                                  f"model group {group!r} read it as {shown(spelled[name])} and {shown(value)}; "
                                  f"set it explicitly")
            spelled.setdefault(name, value)
            owner.setdefault(name, arch)
    return spelled


def _who_declares(group: str, declaring: dict[str, Architecture]) -> str:
    """The tail of an unknown-key line: which members declare which options, or that none do."""
    if not declaring:
        return f"no architecture of model group {group!r} declares options; leave model.options empty"
    listed = "; ".join(f"{arch}: {', '.join(entry.option_names())}" for arch, entry in declaring.items())
    return f"the architectures of model group {group!r} declare {listed}"
