"""The names of partition caches: every input that shapes a split, hashed into the cache file's
name and stored in it, so a change of any input means another file and an unchanged config finds
its old one (a new key must leave the JSON of configs that do not use it as it was)."""
from __future__ import annotations

import hashlib
import json
import os
import re

from htfl_dist.config import DataConfig, partition_cache_dir

from .cache import FORMAT_VERSION
from .datasets import dataset_fingerprint
from .partition import LEGACY_MIN_SAMPLES
from .partition_pfllib import PFLLIB_EXDIR_MIN_SAMPLES, pfllib_least_samples


def safe_label(text: str) -> str:
    """A directory's name made safe for a file name (a PFLlib cache is named after it)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("._") or "dataset"


def canonical_json(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def cache_path(data: DataConfig, label: str, partition: str, key_json: str) -> str:
    """``<cache_dir>/<label>-<partition>-<hash>.h5``, the hash over everything that shapes the split."""
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:16]
    return os.path.join(partition_cache_dir(data), f"{label}-{partition}-{digest}.h5")


def partition_key(data: DataConfig, num_clients: int, seed: int, root: str | None,
                   batch_size: int, source: list | None = None) -> dict:
    """Every input that changes a split drawn here. Its JSON is hashed into the file name and
    stored in the file, so any change means another cache; a new key must leave the JSON of
    configs that do not use it unchanged, or every existing cache would be rebuilt. ``source``:
    the fingerprint of what is read (default: the whole dataset's)."""
    key = {
        "format_version": FORMAT_VERSION,
        "dataset": data.dataset,
        "source": dataset_fingerprint(data.dataset, root) if source is None else source,
        "partition": data.partition,
        "subsample": float(data.subsample),
        "train_ratio": float(data.train_ratio),
        "seed": int(seed),
        "num_clients": int(num_clients),
    }
    if data.partition in ("pathological", "exdir"):
        key["classes_per_client"] = int(data.classes_per_client)
    if data.partition in ("dirichlet", "exdir"):
        key["beta"] = float(data.beta)
    if data.balance:  # only when set: the keys of unbalanced splits stay as they were
        key["balance"] = True
    if data.options:  # a dataset's own options (spelled out); only when it has some: other keys unchanged
        key["options"] = data.options
    if data.partition_rules == "legacy":  # the key as before the option existed: caches stay valid
        if data.partition == "dirichlet":
            key["min_samples_per_client"] = legacy_min_samples(data)
    else:
        key["partition_rules"] = data.partition_rules
        key["min_samples_per_client"] = data.min_samples_per_client
        if data.min_samples_per_client is None and _guard_uses_batch_size(data):
            key["batch_size"] = int(batch_size)
    return key


def _guard_uses_batch_size(data: DataConfig) -> bool:
    """PFLlib's ``least_samples`` (from the batch size) guards dir and shapes unbalanced pat's
    shares; exdir's guard is a fixed 10 and balanced pat draws nothing."""
    return data.partition == "dirichlet" or (data.partition == "pathological" and not data.balance)


def legacy_min_samples(data: DataConfig) -> int:
    if data.min_samples_per_client is None:
        return LEGACY_MIN_SAMPLES
    return int(data.min_samples_per_client)


def pfllib_guard(data: DataConfig, n_samples: int, num_clients: int, batch_size: int) -> int:
    """The user's data.min_samples_per_client, else PFLlib's own: least_samples for this data
    (dir, pat), a fixed 10 for exdir."""
    if data.min_samples_per_client is not None:
        return int(data.min_samples_per_client)
    if data.partition == "exdir":
        return PFLLIB_EXDIR_MIN_SAMPLES
    return pfllib_least_samples(n_samples, num_clients, batch_size, data.train_ratio)
