"""Experiment identity: which config keys define what a run computes, their hash, and what a
resumed run may change.

A run directory and its checkpoints carry the hash of the config's experiment part; resuming
needs an equal hash. The experiment part leaves out plumbing (``PLUMBING_KEYS``), where the
data lives and when a run gives up, and writes every key added after runs existed the way those
runs were hashed (``KEYS_ADDED_LATER``, the legacy partition view), so old run directories keep
resuming. tests/runtime/test_config_identity.py pins the hash of every shipped config.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from htfl_dist.config.generator_section import GeneratorConfig
from htfl_dist.config.participation_section import ParticipationConfig
from htfl_dist.errors import shown

PLUMBING_KEYS = ("runtime", "output", "rounds", "eval_every", "checkpoint_every", "checkpoint_keep", "on_bad_upload",
                 "plugins", "stop")
"""Not part of the experiment: plumbing, the run length and when to stop early (a resumed run may
extend `rounds`, except under ``train.lr_schedule=cosine``, whose learning rates depend on it) and
the plugin modules (they provide names; the names and options they resolve to are the experiment, so
moving a plugin to another module keeps a run's hash)."""
DATA_LOCATION_KEYS = ("root", "cache_dir", "allow_changed")
"""Where the data lives: moving it (another node, a new cache) is the same run; and the consent to
resume on changed data (the data themselves are checked against the checkpoint's, not hashed)."""
MODEL_LOCATION_KEYS = ("pretrained",)
"""Where a model's files live (pre-trained weights): moving them is the same run, so the experiment
says only that they are used (``True``); their bytes are checked against the checkpoint's, not hashed."""
TRAIN_STOPPING_KEYS = ("max_diverged_rounds",)
"""When a run gives up, not what its rounds compute."""


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


KEYS_ADDED_LATER: dict[str, dict[str, Any]] = {
    "model": {"init": "per_client", "pretrained": None, "pretrained_part": "features"},
    "train": {"batch_order": "shuffled", "last_batch": "keep", "client_batching": "off", "optimizer": "sgd",
              "momentum": 0.0, "weight_decay": 0.0, "lr_schedule": "constant", "lr_decay": 0.99,
              "lr_step_rounds": 0, "lr_min": 0.0},
    "data": {"vocab_size": None, "few_shot": 0, "balance": False, "domains": []},
    "eval": {"new_clients": 0, "new_client_epochs": 1},
    "participation": {"late": "drop", "availability_period_s": 0.0, "tiers": None},
}
"""Keys added after runs existed, per section, with the default that was the only behaviour
before them: at that default a key is left out of the experiment, so earlier runs and their
checkpoints keep their hash."""


def _drop_defaults_added_later(view: dict[str, Any]) -> None:
    for section, defaults in KEYS_ADDED_LATER.items():
        values = view.get(section, {})
        for key, default in defaults.items():
            if values.get(key, default) == default:
                values.pop(key, None)


def experiment_view(tree: dict[str, Any]) -> dict[str, Any]:
    """The experiment part of a config dict (a copy). Tolerates keys that are absent, so it also
    reads the experiments stored by older versions in checkpoint manifests."""
    view = copy.deepcopy(tree)
    if view.get("generator") == dataclasses.asdict(GeneratorConfig()):
        view.pop("generator")  # the default generator is pinned by its sha256; older runs stay resumable
    if not view.get("privacy", {}).get("enabled", False):
        view.pop("privacy", None)  # off, the section changes nothing: runs without it keep their hash
    if view.get("participation") == dataclasses.asdict(ParticipationConfig()):
        view.pop("participation")  # everyone aggregated, no clock: runs made before it keep their hash
    _drop_defaults_added_later(view)
    if view.get("eval") == {"clients_fraction": 1.0}:
        view.pop("eval")  # every client tested: runs made before sampled evaluation keep their hash
    _legacy_partition_view(view.get("data", {}))
    for key in PLUMBING_KEYS:
        if key == "rounds" and view.get("train", {}).get("lr_schedule") == "cosine":
            continue  # the cosine schedule spans the run: its length decides every round's lr
        view.pop(key, None)
    for key in DATA_LOCATION_KEYS:
        view.get("data", {}).pop(key, None)
    for key in MODEL_LOCATION_KEYS:
        if view.get("model", {}).get(key) is not None:
            view["model"][key] = True
    for key in TRAIN_STOPPING_KEYS:
        view.get("train", {}).pop(key, None)
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
