"""From a config to a partition cache: which file the config needs, and what goes into it.

:func:`prepare_partition` is the one entry point. It names the cache by a hash of every input
that changes the split (format version, dataset, a fingerprint of the source files, partition
parameters, subsample, train_ratio, seed, num_clients: :func:`partition_key`), reuses the file
when it exists and is complete, and otherwise builds it: for a split drawn here, it reads the
dataset and draws every client's (train, test) indices (:func:`_build_indices`, by the legacy or
PFLlib's rules); for ``data.partition=pfllib`` it converts a directory PFLlib already wrote.

The file itself (layout, atomic write, reading) is :mod:`htfl_dist.data.cache`; the draws are
:mod:`htfl_dist.data.partition` and :mod:`htfl_dist.data.partition_pfllib`. This module is the
glue that decides, and the only place that knows which config keys enter a cache's name.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from htfl_dist.config import DataConfig
from htfl_dist.config.rules import check_value
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.seeding import numpy_rng

from .cache import (
    FORMAT_VERSION,
    ClientArrays,
    PartitionInfo,
    is_complete,
    read_partition_info,
    write_cache,
)
from .cache_keys import cache_path, canonical_json, legacy_min_samples, partition_key, pfllib_guard, safe_label
from .datasets import dataset_root, dataset_source, load_dataset
from .partition import (
    partition_dirichlet,
    partition_pathological,
    split_train_test,
    subsample_indices,
)
from .partition_pfllib import (
    PFLLIB_BATCH_SIZE,
    pfllib_client_splits,
)
from .pfllib import (
    MAX_VOCAB_SIZE,
    check_class_count,
    check_labels,
    input_kind_of,
    pfllib_fingerprint,
    pickle_refusal,
    read_pfllib_config,
    read_pfllib_file,
)
from .sources import check_arrays
from .sources.domains import check_domains, domain_of_client, domain_suite, load_domains

Report = Callable[[str], None]
"""Receives one progress line per step (rank 0 prints them)."""


# --------------------------------------------------------------------------- a split drawn here


def _build_indices(data: DataConfig, labels: np.ndarray, num_classes: int, num_clients: int,
                   seed: int, batch_size: int = PFLLIB_BATCH_SIZE) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client (train indices, test indices) into the full dataset."""
    data.check()  # load_config's checks (exdir and balance need the pfllib rules) for a config built in code
    subset = subsample_indices(labels, data.subsample, numpy_rng(seed, "subsample"))
    sub_labels = labels[subset]
    if data.partition_rules == "pfllib":
        splits = pfllib_client_splits(
            sub_labels, num_clients, num_classes, partition=data.partition, seed=seed,
            least_samples=pfllib_guard(data, sub_labels.size, num_clients, batch_size),
            train_ratio=data.train_ratio, beta=data.beta,
            classes_per_client=data.classes_per_client, max_tries=data.max_partition_tries,
            balance=data.balance,
        )
        return [(subset[train], subset[test]) for train, test in splits]
    rng = numpy_rng(seed, "partition")
    if data.partition == "pathological":
        parts = partition_pathological(
            sub_labels, num_clients, data.classes_per_client, num_classes, rng
        )
    else:
        parts = partition_dirichlet(
            sub_labels, num_clients, data.beta, num_classes, rng,
            min_samples=legacy_min_samples(data), max_tries=data.max_partition_tries,
        )
    out = []
    for cid, part in enumerate(parts):
        train, test = split_train_test(subset[part], data.train_ratio, numpy_rng(seed, "split", cid))
        out.append((train, test))
    return out


def _prepare_generated(data: DataConfig, num_clients: int, seed: int, report: Report,
                       batch_size: int) -> PartitionInfo:
    _check_classes_per_client(data, dataset_source(data.dataset).num_classes)  # before the dataset is read
    root = dataset_root(data)
    key = partition_key(data, num_clients, seed, root, batch_size)
    key_json = canonical_json(key)
    path = cache_path(data, data.dataset, data.partition, key_json)
    if is_complete(path, key_json):
        report(f"data: partition cache found ({path})")
        return read_partition_info(path)

    report(f"data: no partition cache for this config yet; reading {data.dataset} "
           f"from {root or 'its default location'}")
    arrays = load_dataset(data.dataset, root, data.options)
    x_format = check_arrays(arrays, data.vocab_size or MAX_VOCAB_SIZE)
    report(f"data: {arrays.labels.shape[0]} samples, {arrays.num_classes} classes; partitioning "
           f"({data.partition}, {data.partition_rules} rules) into {num_clients} clients")
    splits = _build_indices(data, arrays.labels, arrays.num_classes, num_clients, seed, batch_size)
    images, labels = arrays.images, arrays.labels

    def client_arrays(cid: int) -> ClientArrays:
        train, test = splits[cid]
        return images[train], labels[train], images[test], labels[test]

    square = images.ndim == 4 and images.shape[2] == images.shape[3]
    attrs = {
        "format_version": FORMAT_VERSION,
        "dataset": data.dataset,
        "partition": data.partition,
        "num_classes": int(arrays.num_classes),
        "in_channels": int(images.shape[1]) if square else 0,
        "image_size": int(images.shape[2]) if square else 0,
        "num_clients": int(num_clients),
        "x_format": x_format,
        "key_json": key_json,
    }
    if x_format == "tokens":
        attrs["vocab_size"] = data.vocab_size or int(images[:, :-1].max(initial=0)) + 1
    report(f"data: writing the partition cache {path}")
    write_cache(path, attrs, num_clients, arrays.num_classes, client_arrays)
    return read_partition_info(path)


def _check_classes_per_client(data: DataConfig, num_classes: int | None) -> None:
    """``data.classes_per_client`` within the dataset's classes (when they are known up front)."""
    if data.partition in ("pathological", "exdir") and num_classes and data.classes_per_client > num_classes:
        raise ConfigError(
            f"config key 'data.classes_per_client' is {data.classes_per_client} but the dataset "
            f"has only {num_classes} classes; use a value in 1..{num_classes}"
        )


# --------------------------------------------------------------------------- domains (data.domains)


def _prepare_domains(data: DataConfig, num_clients: int, seed: int, report: Report,
                     batch_size: int) -> PartitionInfo:
    """Client i gets domain i mod D; each domain's samples are split among its own clients by
    ``data.partition`` exactly as a whole dataset would be (the same rules, the split seed, that
    domain's labels alone), so every client's train and test samples come from its domain."""
    suite = domain_suite(data.dataset)
    domains = check_domains(suite, list(data.domains), num_clients)
    _check_classes_per_client(data, suite.num_classes)
    owners = domain_of_client(num_clients, len(domains))
    clients_of = [list(range(d, num_clients, len(domains))) for d in range(len(domains))]  # client i: domain i mod D
    folder = suite.folder(dataset_root(data))
    source = []
    for domain in domains:
        suite.files(folder, domain)  # a missing domain: one line naming its files
        source.append([domain, *suite.fingerprint(folder, domain)])
    key = partition_key(data, num_clients, seed, folder, batch_size, source=source)
    key["domains"] = domains
    key["domain_of_client"] = "i mod D"
    key_json = canonical_json(key)
    label = safe_label(f"{data.dataset}-{'+'.join(domains)}")
    path = cache_path(data, label, data.partition, key_json)
    if is_complete(path, key_json):
        report(f"data: partition cache found ({path})")
        return read_partition_info(path)

    report(f"data: no partition cache for this config yet; reading {data.dataset} domains "
           f"{', '.join(domains)} from {folder}")
    parts = load_domains(suite, folder, domains)
    num_classes = int(max(int(labels.max()) for _, labels in parts if labels.size) + 1)
    splits: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
    for d, (domain, (_, labels)) in enumerate(zip(domains, parts, strict=True)):
        members = clients_of[d]
        report(f"data: domain {domain}: {labels.shape[0]} samples, {num_classes} classes; partitioning "
               f"({data.partition}, {data.partition_rules} rules) into clients {_client_list(members)}")
        for cid, (train, test) in zip(members, _build_indices(data, labels, num_classes, len(members), seed,
                                                               batch_size), strict=True):
            splits[cid] = (d, train, test)

    def client_arrays(cid: int) -> ClientArrays:
        d, train, test = splits[cid]
        images, labels = parts[d]
        return images[train], labels[train], images[test], labels[test]

    attrs = {
        "format_version": FORMAT_VERSION,
        "dataset": data.dataset,
        "partition": data.partition,
        "num_classes": num_classes,
        "in_channels": 3,
        "image_size": int(suite.image_size),
        "num_clients": int(num_clients),
        "x_format": "uint8",
        "key_json": key_json,
        "domains": ",".join(domains),
        "domain_of_client": np.asarray(owners, dtype=np.int64),
    }
    report(f"data: writing the partition cache {path}")
    write_cache(path, attrs, num_clients, num_classes, client_arrays)
    return read_partition_info(path)


def _client_list(members: list[int]) -> str:
    shown_ = ", ".join(str(cid) for cid in members[:6])
    return shown_ + (f", ... ({len(members)} clients)" if len(members) > 6 else "")


# --------------------------------------------------------------------------- a PFLlib directory


def _prepare_pfllib(data: DataConfig, num_clients: int, report: Report) -> PartitionInfo:
    directory = os.path.abspath(data.pfllib_dir or "")
    if not data.pfllib_dir:
        raise ConfigError("data.partition=pfllib needs data.pfllib_dir=DIR (a PFLlib dataset directory)")
    if data.subsample != 1.0:
        raise ConfigError(
            f"config key 'data.subsample' is {data.subsample} but data.partition=pfllib reads a "
            f"finished PFLlib split; leave data.subsample at 1"
        )
    config = read_pfllib_config(directory, num_clients)
    if not data.allow_pickle:
        # Refuse before anything is read, whether or not a converted cache already exists.
        raise pickle_refusal(directory)
    num_classes = int(config["num_classes"])
    label = safe_label(os.path.basename(directory))
    key = {
        "format_version": FORMAT_VERSION,
        "partition": "pfllib",
        "directory": directory,
        "source": pfllib_fingerprint(directory, num_clients),
        "num_clients": int(num_clients),
    }
    key_json = canonical_json(key)
    path = cache_path(data, label, "pfllib", key_json)
    if is_complete(path, key_json):
        report(f"data: partition cache found ({path})")
        return read_partition_info(path)

    report(f"data: converting the PFLlib split {directory} into the partition cache {path}")
    shape, x_dtype = _pfllib_sample_format(directory, num_clients, data.vocab_size)
    kind = input_kind_of(np.zeros((0, *shape), dtype=x_dtype))
    largest = {"id": -1, "label": -1}

    def client_arrays(cid: int) -> ClientArrays:
        out = []
        for part in ("train", "test"):
            path_ = os.path.join(directory, part, f"{cid}.npz")
            x, y = read_pfllib_file(path_, True, directory, vocab_size=data.vocab_size)
            if x.shape[0] == 0:
                x = np.zeros((0, *shape), dtype=x_dtype)
            if x.shape[1:] != shape or x.dtype != x_dtype:
                raise DataError(
                    f"{path_}: x is {_describe_format(x.shape[1:], x.dtype)} but the first client's is "
                    f"{_describe_format(shape, x_dtype)}; all clients must hold the same data format"
                )
            check_labels(path_, y, num_classes)
            largest["label"] = max(largest["label"], int(y.max()) if y.size else -1)
            if kind == "text" and x.size:
                largest["id"] = max(largest["id"], int(x[:, :-1].max()))
                attrs["vocab_size"] = largest["id"] + 1
            out.extend([x, y])
        if cid == num_clients - 1:  # every label read, the cache not yet in place
            check_class_count(directory, num_classes, largest["label"])
        return out[0], out[1], out[2], out[3]

    square = kind == "image" and shape[1] == shape[2]
    attrs = {
        "format_version": FORMAT_VERSION,
        "dataset": label,
        "partition": "pfllib",
        "num_classes": num_classes,
        "in_channels": int(shape[0]) if square else 0,
        "image_size": int(shape[1]) if square else 0,
        "num_clients": int(num_clients),
        "x_format": {"text": "tokens", "tabular": "float32"}.get(kind, "uint8" if x_dtype == np.uint8 else "float32"),
        "key_json": key_json,
    }
    write_cache(path, attrs, num_clients, num_classes, client_arrays)
    return read_partition_info(path)


def _pfllib_sample_format(directory: str, num_clients: int,
                          vocab_size: int | None) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of one sample, from the first client whose train file is not empty."""
    for cid in range(num_clients):
        x, _ = read_pfllib_file(os.path.join(directory, "train", f"{cid}.npz"), True, directory,
                                vocab_size=vocab_size)
        if x.shape[0]:
            return x.shape[1:], x.dtype
    raise DataError(f"PFLlib dataset directory {directory}: every client's train file is empty")


def _describe_format(shape: tuple[int, ...], dtype: np.dtype) -> str:
    kind = input_kind_of(np.zeros((0, *shape), dtype=dtype))
    if kind == "text":
        return f"text padded to {shape[0] - 1}"
    return f"{dtype} {' x '.join(str(size) for size in shape)}"


# --------------------------------------------------------------------------- the entry point


def _apply_vocab_size(info: PartitionInfo, data: DataConfig) -> PartitionInfo:
    """``data.vocab_size``: a larger vocabulary than the data's largest id + 1 (HtFLlib's
    ``-vs 32000``, the tokenizer's size); smaller would leave ids without an embedding. Unset, the
    data's vocabulary must stay within the cap a conversion checks (a cache converted before the
    cap existed may not)."""
    if data.vocab_size is None:
        if info.input_kind == "text" and info.vocab_size > MAX_VOCAB_SIZE:
            raise DataError(f"partition cache {info.path} holds token id {info.vocab_size - 1}, outside the "
                            f"vocabulary of {MAX_VOCAB_SIZE} (the most accepted while data.vocab_size is unset); "
                            f"delete it and fix the PFLlib files it was converted from")
        return info
    if info.input_kind != "text":
        raise ConfigError(f"config key 'data.vocab_size' is {data.vocab_size} but the data is "
                          f"{info.inputs().describe()}, not text; leave data.vocab_size unset")
    if data.vocab_size < info.vocab_size:
        raise ConfigError(f"config key 'data.vocab_size' is {data.vocab_size} but the data holds token id "
                          f"{info.vocab_size - 1}; use at least {info.vocab_size} or leave it unset")
    info.vocab_size = data.vocab_size
    return info


def _silent(line: str) -> None:
    pass


def prepare_partition(data: DataConfig, num_clients: int, seed: int, report: Report = _silent, *,
                      batch_size: int = PFLLIB_BATCH_SIZE) -> PartitionInfo:
    """Build the partition cache for this config if it is missing; return its summary.

    Safe to call from every rank at once: the cache is written atomically and reused
    when it already exists with the same key. ``report`` receives one line per step (rank 0
    prints them: building a cache from a large dataset takes minutes). ``batch_size`` is
    ``train.batch_size``: with data.partition_rules=pfllib and no data.min_samples_per_client
    it enters PFLlib's size guard (10, PFLlib's generator constant, when not given). The split
    is drawn from ``data.partition_seed`` when set, else from the run's ``seed``.
    """
    check_value("num_clients", num_clients, at_least=1)
    if data.domains and data.partition == "pfllib":
        raise ConfigError("config key 'data.domains' splits a dataset's domains here, but data.partition=pfllib "
                          "reads a finished split; leave data.domains empty or pick dirichlet, pathological or exdir")
    if data.partition == "pfllib":
        return _apply_vocab_size(_prepare_pfllib(data, num_clients, report), data)
    if data.partition not in ("pathological", "dirichlet", "exdir"):
        raise ConfigError(
            f"config key 'data.partition' is {data.partition!r}; allowed: pathological, "
            f"dirichlet, exdir, pfllib"
        )
    data.check()  # before the dataset is read
    split_seed = seed if data.partition_seed is None else data.partition_seed
    if data.domains:
        return _prepare_domains(data, num_clients, split_seed, report, batch_size)
    return _apply_vocab_size(_prepare_generated(data, num_clients, split_seed, report, batch_size), data)
