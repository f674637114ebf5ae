"""Experiment identity: which config keys define what a run computes, their hash, and what a
resumed run may change.

A run directory and its checkpoints carry the hash of the config's experiment part; resuming
needs an equal hash. What a key contributes is declared where the key is declared
(``config.rules.Identity`` in the field's metadata: plumbing, added later with its default, a
location, a renamed key or value, a section left out when off) and walked here, for the config's
sections and for each algorithm's options alike; only the two conditional rules (``rounds`` under
the cosine schedule, the legacy partition view) are written out below. Old run directories keep
resuming; tests/runtime/test_config_identity.py pins the hash of every shipped config.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from htfl_dist.config.rules import Identity, TheDefault
from htfl_dist.errors import shown


def _legacy_partition_view(data: dict[str, Any]) -> None:
    """Under the legacy partition rules, write the data section as it was before
    ``data.partition_rules`` and ``data.partition_seed`` existed (no such keys; the guard unset
    means 10), so the runs and checkpoints made then keep their config hash and stay resumable."""
    if data.get("partition_seed") is None:
        data.pop("partition_seed", None)
    if data.get("partition_rules", "legacy") != "legacy":
        return
    data.pop("partition_rules", None)
    if data.get("min_samples_per_client", 10) is None:
        data["min_samples_per_client"] = 10


_ALGORITHM_OPTIONS: dict[str, type] = {}
"""Each registered algorithm's options dataclass, by case-folded name, so the hash can walk the
identity its fields declare (a renamed option, one added later). The algorithm registry fills it
when an algorithm registers (the config layer imports no algorithm)."""


def declare_algorithm_options(name: str, options: type) -> None:
    """Called by ``algorithms.register_algorithm``: ``algo.*`` of ``name`` follows ``options``' fields."""
    _ALGORITHM_OPTIONS[name.casefold()] = options


def section_view(section: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a section of a config dict; keys may be missing, as in older manifests) as it
    enters the hash, following each field's declared :class:`Identity`: plumbing left out, a key
    added later left out at its default, a location hashed as "set", renamed keys and values
    written as they were hashed, and sub-sections walked the same way (and left out where they
    declare so)."""
    view = dict(values)
    for item in dataclasses.fields(section):
        if item.name not in view:
            continue
        rule: Identity = item.metadata.get("identity", Identity())
        default = _default_of(item)
        value = view.pop(item.name)
        if rule.plumbing or (rule.added_later and value == _as_dict(_left_out_at(rule, default))):
            continue
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = section_view(type(default), value)
            if rule.omit_when_default and value == section_view(type(default), _as_dict(default)):
                continue
            if rule.omit_unless and not any(value.get(key, False) for key in rule.omit_unless):
                continue
        if rule.location and value is not None:
            value = True
        value = dict(rule.hashed_values).get(value, value) if _hashable(value) else value
        view[rule.hashed_as or item.name] = value
    return view


def _left_out_at(rule: Identity, default: Any) -> Any:
    """The value an added-later key is left out of the hash at: what runs made before it computed."""
    return default if isinstance(rule.before, TheDefault) else rule.before


def stored_options(algorithm: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (the ``algo`` of a stored experiment, as hashed) with every added-later option
    whose default has changed since (``Identity.before``) written back where the view left it
    out: a missing key meant the value before, not today's default, so spelling the stored
    options out again must not turn an old run into one at the new default."""
    options = _ALGORITHM_OPTIONS.get(algorithm.casefold())
    filled = dict(values)
    for item in dataclasses.fields(options) if options is not None else ():
        rule: Identity = item.metadata.get("identity", Identity())
        if rule.added_later and not isinstance(rule.before, TheDefault) \
                and item.name not in filled and (rule.hashed_as or item.name) not in filled:
            filled[item.name] = rule.before
    return filled


def _default_of(item: dataclasses.Field) -> Any:
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def _as_dict(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def experiment_view(tree: dict[str, Any], config: type) -> dict[str, Any]:
    """The experiment part of a config dict (a copy), ``config`` being the Config dataclass whose
    fields declare each key's identity. Tolerates keys that are absent, so it also reads the
    experiments stored by older versions in checkpoint manifests. Two rules are conditional and
    so written here: ``rounds`` is plumbing except under ``train.lr_schedule=cosine`` (the
    schedule spans the run: its length decides every round's lr), and the legacy partition
    rules' view of the data section."""
    tree = copy.deepcopy(tree)
    cosine_rounds = tree.get("rounds") if tree.get("train", {}).get("lr_schedule") == "cosine" else None
    view = section_view(config, tree)
    if cosine_rounds is not None:
        view["rounds"] = cosine_rounds
    options = _ALGORITHM_OPTIONS.get(str(view.get("algorithm", "")).casefold())
    if options is not None and isinstance(view.get("algo"), dict):
        view["algo"] = section_view(options, view["algo"])
    _legacy_partition_view(view.get("data", {}))
    return view


def spelled_out_partition_rules(view: dict[str, Any]) -> dict[str, Any]:
    """``view`` with ``data.partition_rules`` written out (a copy): the legacy view drops the key to
    keep old hashes, so a missing key means legacy. Comparisons use this, so resuming a run made
    before the default changed names the difference ('legacy' -> 'pfllib') instead of None."""
    view = copy.deepcopy(view)
    if isinstance(view.get("data"), dict):
        view["data"].setdefault("partition_rules", "legacy")
    return view


def experiment_differences(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two ``Config.experiment()`` dicts, as 'key: a -> b'."""
    if not prefix:
        before, after = spelled_out_partition_rules(before), spelled_out_partition_rules(after)
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += experiment_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key}: {shown(old)} -> {shown(new)}")
    return changes


def experiment_hash(experiment: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of an experiment dict as sorted-key JSON: what summaries and
    checkpoints carry (``Config.config_hash``)."""
    text = json.dumps(experiment, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
