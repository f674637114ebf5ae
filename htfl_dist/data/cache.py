"""The on-disk partition cache (HDF5 via h5py) and the per-client reader.

File ``<cache_dir>/<dataset>-<partition>-<hash>.h5``; ``hash`` covers every input that
changes the split (format version, dataset, a fingerprint of the source files, partition
parameters, subsample, train_ratio, seed, num_clients). Layout::

    /                       attrs: format_version, dataset, partition, num_classes,
                                   in_channels, image_size, num_clients, x_format, key_json,
                                   vocab_size (text only), complete
    /class_counts           int64 num_clients x num_classes (train split), for reports
    /client_<id>/train_x    uint8 N x C x H x W  (x_format "uint8")  or float32 already
    /client_<id>/train_y    int64 N               normalised (x_format "float32", PFLlib: N x C x H x W
    /client_<id>/test_x                           or N x F) or int64 text rows N x (L + 1)
    /client_<id>/test_y                           (x_format "tokens", PFLlib)

The input kind and shape are read back from ``x_format`` and the stored x's shape
(:func:`read_partition_info`); ``in_channels`` and ``image_size`` are 0 unless x holds square
pictures.

A cache is written to a private temp file in the same directory, then moved into place with
``os.replace``: a reader never sees a half-written file, and concurrent builders (several ranks
starting at once) each write their own temp file and the last rename wins, with equal content.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import h5py
import numpy as np
import torch

from htfl_dist.atomic import replaced_atomically
from htfl_dist.config import DataConfig, partition_cache_dir
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.models.inputs import InputSpec
from htfl_dist.seeding import numpy_rng

from .datasets import dataset_fingerprint, dataset_root, dataset_source, load_dataset
from .partition import (
    LEGACY_MIN_SAMPLES,
    PFLLIB_BATCH_SIZE,
    partition_dirichlet,
    partition_pathological,
    pfllib_client_splits,
    pfllib_least_samples,
    split_train_test,
    subsample_indices,
)
from .pfllib import (
    input_kind_of,
    pfllib_fingerprint,
    pickle_refusal,
    read_pfllib_config,
    read_pfllib_file,
)

FORMAT_VERSION = 1
"""Bump when the partition algorithms or the file layout change: old caches are then ignored."""


@dataclass
class PartitionInfo:
    """What the runtime needs to know about a partition without reading any client's data.

    ``in_channels`` and ``image_size`` describe square pictures and are 0 for other data;
    ``input_kind``, ``input_shape`` and ``vocab_size`` describe any data (:meth:`inputs`)."""

    path: str
    num_classes: int
    in_channels: int
    image_size: int
    num_clients: int
    class_counts: np.ndarray
    input_kind: str = "image"
    input_shape: tuple[int, ...] = ()
    vocab_size: int = 0

    def inputs(self) -> InputSpec:
        """One sample's kind and shape (square pictures when ``input_shape`` was not given)."""
        if not self.input_shape:
            return InputSpec.image(self.in_channels, self.image_size)
        return InputSpec(self.input_kind, self.input_shape, self.vocab_size)  # type: ignore[arg-type]


@dataclass
class ClientSplit:
    """One logical client's data, ready for training: x float32 normalised, y int64."""

    client_id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


ClientArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


# --------------------------------------------------------------------------- HDF5 helpers


def _open_read(path: str) -> h5py.File:
    """Open read-only without HDF5 file locking (caches are immutable once renamed into
    place, and locking fails on some cluster filesystems)."""
    try:
        return h5py.File(path, "r", locking=False)
    except TypeError:  # very old h5py without the keyword
        return h5py.File(path, "r")


def _is_complete(path: str, key_json: str) -> bool:
    try:
        with _open_read(path) as f:
            return (
                bool(f.attrs.get("complete", False))
                and int(f.attrs.get("format_version", -1)) == FORMAT_VERSION
                and str(f.attrs.get("key_json", "")) == key_json
            )
    except (OSError, KeyError, ValueError):
        return False


def _write_cache(
    path: str,
    attrs: dict,
    num_clients: int,
    num_classes: int,
    client_arrays: Callable[[int], ClientArrays],
) -> None:
    """Write every client's arrays to a temp file beside ``path``, then rename atomically."""
    try:
        with replaced_atomically(path) as tmp:
            _write_clients(tmp, attrs, num_clients, num_classes, client_arrays)
    except OSError as exc:
        raise DataError(
            f"cannot write the partition cache {path} ({exc.strerror or exc}); set data.cache_dir=DIR "
            f"to a writable directory with free space"
        ) from None


def _write_clients(tmp: str, attrs: dict, num_clients: int, num_classes: int,
                   client_arrays: Callable[[int], ClientArrays]) -> None:
    counts = np.zeros((num_clients, num_classes), dtype=np.int64)
    try:
        handle = h5py.File(tmp, "w", locking=False)
    except TypeError:
        handle = h5py.File(tmp, "w")
    with handle as f:
        for cid in range(num_clients):
            train_x, train_y, test_x, test_y = client_arrays(cid)
            group = f.create_group(f"client_{cid}")
            group.create_dataset("train_x", data=train_x)
            group.create_dataset("train_y", data=train_y.astype(np.int64))
            group.create_dataset("test_x", data=test_x)
            group.create_dataset("test_y", data=test_y.astype(np.int64))
            if train_y.size and (train_y.min() < 0 or train_y.max() >= num_classes):
                raise DataError(
                    f"client {cid} has label {int(train_y.max())} outside 0..{num_classes - 1}"
                )
            counts[cid] = np.bincount(train_y, minlength=num_classes)[:num_classes]
        f.create_dataset("class_counts", data=counts)
        for key, value in attrs.items():  # after the clients: reading them may complete attrs (vocab_size)
            f.attrs[key] = value
        f.attrs["complete"] = True


# --------------------------------------------------------------------------- building


def _safe_label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("._") or "dataset"


def _key_json(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _partition_key(data: DataConfig, num_clients: int, seed: int, root: str | None,
                   batch_size: int) -> dict:
    key = {
        "format_version": FORMAT_VERSION,
        "dataset": data.dataset,
        "source": dataset_fingerprint(data.dataset, root),
        "partition": data.partition,
        "subsample": float(data.subsample),
        "train_ratio": float(data.train_ratio),
        "seed": int(seed),
        "num_clients": int(num_clients),
    }
    if data.partition == "pathological":
        key["classes_per_client"] = int(data.classes_per_client)
    elif data.partition == "dirichlet":
        key["beta"] = float(data.beta)
    if data.partition_rules == "legacy":  # the key as before the option existed: caches stay valid
        if data.partition == "dirichlet":
            key["min_samples_per_client"] = _legacy_min_samples(data)
    else:
        key["partition_rules"] = data.partition_rules
        key["min_samples_per_client"] = data.min_samples_per_client
        if data.min_samples_per_client is None:  # PFLlib's guard depends on the batch size
            key["batch_size"] = int(batch_size)
    return key


def _legacy_min_samples(data: DataConfig) -> int:
    if data.min_samples_per_client is None:
        return LEGACY_MIN_SAMPLES
    return int(data.min_samples_per_client)


def _pfllib_guard(data: DataConfig, n_samples: int, num_clients: int, batch_size: int) -> int:
    """The user's data.min_samples_per_client, else PFLlib's least_samples for this data."""
    if data.min_samples_per_client is not None:
        return int(data.min_samples_per_client)
    return pfllib_least_samples(n_samples, num_clients, batch_size, data.train_ratio)


def _build_indices(data: DataConfig, labels: np.ndarray, num_classes: int, num_clients: int,
                   seed: int, batch_size: int = PFLLIB_BATCH_SIZE) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client (train indices, test indices) into the full dataset."""
    subset = subsample_indices(labels, data.subsample, numpy_rng(seed, "subsample"))
    sub_labels = labels[subset]
    if data.partition_rules == "pfllib":
        splits = pfllib_client_splits(
            sub_labels, num_clients, num_classes, partition=data.partition, seed=seed,
            least_samples=_pfllib_guard(data, sub_labels.size, num_clients, batch_size),
            train_ratio=data.train_ratio, beta=data.beta,
            classes_per_client=data.classes_per_client, max_tries=data.max_partition_tries,
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
            min_samples=_legacy_min_samples(data), max_tries=data.max_partition_tries,
        )
    out = []
    for cid, part in enumerate(parts):
        train, test = split_train_test(subset[part], data.train_ratio, numpy_rng(seed, "split", cid))
        out.append((train, test))
    return out


def _prepare_generated(data: DataConfig, num_clients: int, seed: int, report: Report,
                       batch_size: int) -> PartitionInfo:
    known_classes = dataset_source(data.dataset).num_classes
    if data.partition == "pathological" and known_classes and data.classes_per_client > known_classes:
        # Fail before the dataset is read.
        raise ConfigError(
            f"config key 'data.classes_per_client' is {data.classes_per_client} but the dataset "
            f"has only {known_classes} classes; use a value in 1..{known_classes}"
        )
    root = dataset_root(data)
    key = _partition_key(data, num_clients, seed, root, batch_size)
    key_json = _key_json(key)
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:16]
    path = os.path.join(partition_cache_dir(data), f"{data.dataset}-{data.partition}-{digest}.h5")
    if _is_complete(path, key_json):
        report(f"data: partition cache found ({path})")
        return read_partition_info(path)

    report(f"data: no partition cache for this config yet; reading {data.dataset} "
           f"from {root or 'its default location'}")
    arrays = load_dataset(data.dataset, root)
    report(f"data: {arrays.labels.shape[0]} samples, {arrays.num_classes} classes; partitioning "
           f"({data.partition}, {data.partition_rules} rules) into {num_clients} clients")
    splits = _build_indices(data, arrays.labels, arrays.num_classes, num_clients, seed, batch_size)
    images, labels = arrays.images, arrays.labels

    def client_arrays(cid: int) -> ClientArrays:
        train, test = splits[cid]
        return images[train], labels[train], images[test], labels[test]

    attrs = {
        "format_version": FORMAT_VERSION,
        "dataset": data.dataset,
        "partition": data.partition,
        "num_classes": int(arrays.num_classes),
        "in_channels": int(images.shape[1]),
        "image_size": int(images.shape[2]),
        "num_clients": int(num_clients),
        "x_format": "uint8",
        "key_json": key_json,
    }
    report(f"data: writing the partition cache {path}")
    _write_cache(path, attrs, num_clients, arrays.num_classes, client_arrays)
    return read_partition_info(path)


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
    label = _safe_label(os.path.basename(directory))
    key = {
        "format_version": FORMAT_VERSION,
        "partition": "pfllib",
        "directory": directory,
        "source": pfllib_fingerprint(directory, num_clients),
        "num_clients": int(num_clients),
    }
    key_json = _key_json(key)
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:16]
    path = os.path.join(partition_cache_dir(data), f"{label}-pfllib-{digest}.h5")
    if _is_complete(path, key_json):
        report(f"data: partition cache found ({path})")
        return read_partition_info(path)

    report(f"data: converting the PFLlib split {directory} into the partition cache {path}")
    shape, x_dtype = _pfllib_sample_format(directory, num_clients)
    kind = input_kind_of(np.zeros((0, *shape), dtype=x_dtype))
    largest_id = [-1]

    def client_arrays(cid: int) -> ClientArrays:
        out = []
        for part in ("train", "test"):
            path_ = os.path.join(directory, part, f"{cid}.npz")
            x, y = read_pfllib_file(path_, True, directory)
            if x.shape[0] == 0:
                x = np.zeros((0, *shape), dtype=x_dtype)
            if x.shape[1:] != shape or x.dtype != x_dtype:
                raise DataError(
                    f"{path_}: x is {_describe_format(x.shape[1:], x.dtype)} but the first client's is "
                    f"{_describe_format(shape, x_dtype)}; all clients must hold the same data format"
                )
            if y.size and (y.min() < 0 or y.max() >= num_classes):
                raise DataError(
                    f"{path_}: label {int(y.max())} outside 0..{num_classes - 1} "
                    f"(config.json says num_classes={num_classes})"
                )
            if kind == "text" and x.size:
                largest_id[0] = max(largest_id[0], int(x[:, :-1].max()))
                attrs["vocab_size"] = largest_id[0] + 1
            out.extend([x, y])
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
    _write_cache(path, attrs, num_clients, num_classes, client_arrays)
    return read_partition_info(path)


def _pfllib_sample_format(directory: str, num_clients: int) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of one sample, from the first client whose train file is not empty."""
    for cid in range(num_clients):
        x, _ = read_pfllib_file(os.path.join(directory, "train", f"{cid}.npz"), True, directory)
        if x.shape[0]:
            return x.shape[1:], x.dtype
    raise DataError(f"PFLlib dataset directory {directory}: every client's train file is empty")


def _describe_format(shape: tuple[int, ...], dtype: np.dtype) -> str:
    kind = input_kind_of(np.zeros((0, *shape), dtype=dtype))
    if kind == "text":
        return f"text padded to {shape[0] - 1}"
    return f"{dtype} {' x '.join(str(size) for size in shape)}"


def _apply_vocab_size(info: PartitionInfo, data: DataConfig) -> PartitionInfo:
    """``data.vocab_size``: a larger vocabulary than the data's largest id + 1 (HtFLlib's
    ``-vs 32000``, the tokenizer's size); smaller would leave ids without an embedding."""
    if data.vocab_size is None:
        return info
    if info.input_kind != "text":
        raise ConfigError(f"config key 'data.vocab_size' is {data.vocab_size} but the data is "
                          f"{info.inputs().describe()}, not text; leave data.vocab_size unset")
    if data.vocab_size < info.vocab_size:
        raise ConfigError(f"config key 'data.vocab_size' is {data.vocab_size} but the data holds token id "
                          f"{info.vocab_size - 1}; use at least {info.vocab_size} or leave it unset")
    info.vocab_size = data.vocab_size
    return info


Report = Callable[[str], None]


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
    if num_clients < 1:
        raise ConfigError(f"config key 'num_clients' must be >= 1, got {num_clients}")
    if data.partition == "pfllib":
        return _apply_vocab_size(_prepare_pfllib(data, num_clients, report), data)
    if data.partition not in ("pathological", "dirichlet"):
        raise ConfigError(
            f"config key 'data.partition' is {data.partition!r}; allowed: pathological, "
            f"dirichlet, pfllib"
        )
    split_seed = seed if data.partition_seed is None else data.partition_seed
    return _apply_vocab_size(_prepare_generated(data, num_clients, split_seed, report, batch_size), data)


# --------------------------------------------------------------------------- reading


def read_partition_info(path: str) -> PartitionInfo:
    """The summary of an existing cache file (no client data is read)."""
    try:
        with _open_read(path) as f:
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise DataError(
                    f"partition cache {path} has format version {version}, expected "
                    f"{FORMAT_VERSION}; delete it so it is rebuilt"
                )
            sample_shape = tuple(int(size) for size in f["client_0/train_x"].shape[1:])
            x_format = str(f.attrs.get("x_format", "uint8"))
            kind = "text" if x_format == "tokens" else "image" if len(sample_shape) == 3 else "tabular"
            return PartitionInfo(
                path=path,
                num_classes=int(f.attrs["num_classes"]),
                in_channels=int(f.attrs["in_channels"]),
                image_size=int(f.attrs["image_size"]),
                num_clients=int(f.attrs["num_clients"]),
                class_counts=np.asarray(f["class_counts"][()], dtype=np.int64),
                input_kind=kind,
                input_shape=(sample_shape[0] - 1,) if kind == "text" else sample_shape,
                vocab_size=int(f.attrs.get("vocab_size", 0)),
            )
    except (OSError, KeyError) as exc:
        raise DataError(f"cannot read partition cache {path} ({exc}); delete it so it is rebuilt") from None


def _to_tensor(x: np.ndarray, x_format: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(x))
    if x_format == "tokens":
        return tensor.long()
    if x_format == "uint8":
        # PFLlib: ToTensor (x / 255) then Normalize(mean 0.5, std 0.5) on every channel.
        return tensor.float().div(255.0).sub(0.5).div(0.5)
    return tensor.float()


def load_client_split(path: str, client_id: int) -> ClientSplit:
    """Read only ``client_<client_id>`` from the cache and return normalised tensors."""
    try:
        with _open_read(path) as f:
            num_clients = int(f.attrs["num_clients"])
            if not 0 <= client_id < num_clients:
                raise DataError(
                    f"partition cache {path} holds clients 0..{num_clients - 1}, not {client_id}"
                )
            x_format = str(f.attrs.get("x_format", "uint8"))
            group = f[f"client_{client_id}"]
            arrays = {name: group[name][()] for name in ("train_x", "train_y", "test_x", "test_y")}
    except (OSError, KeyError) as exc:
        raise DataError(f"cannot read client {client_id} from partition cache {path} ({exc}); "
                        f"delete the file so it is rebuilt") from None
    return ClientSplit(
        client_id=client_id,
        train_x=_to_tensor(arrays["train_x"], x_format),
        train_y=torch.from_numpy(arrays["train_y"].astype(np.int64)),
        test_x=_to_tensor(arrays["test_x"], x_format),
        test_y=torch.from_numpy(arrays["test_y"].astype(np.int64)),
    )
