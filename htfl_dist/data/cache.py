"""The on-disk partition cache (HDF5 via h5py): its layout, its atomic writer and its readers.

This module knows the file and nothing about how a split is drawn: :mod:`htfl_dist.data.prepare`
decides which file a config needs (the key, the name) and what goes into it, then hands the
arrays to :func:`write_cache`; the runtime reads the summary (:func:`read_partition_info`) and
each rank only its own clients (:func:`load_client_split`). Layout::

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

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import h5py
import numpy as np
import torch

from htfl_dist.atomic import OutputError, replaced_atomically
from htfl_dist.errors import DataError
from htfl_dist.models.inputs import InputSpec

FORMAT_VERSION = 1
"""Bump when the partition algorithms or the file layout change: old caches are then ignored."""


@dataclass
class PartitionInfo:
    """What the runtime needs to know about a partition without reading any client's data.

    ``in_channels`` and ``image_size`` describe square pictures and are 0 for other data;
    ``input_kind``, ``input_shape`` and ``vocab_size`` describe any data (:meth:`inputs`);
    ``dataset`` and ``pfllib_dir`` say where the data came from (:meth:`describe`)."""

    path: str
    num_classes: int
    in_channels: int
    image_size: int
    num_clients: int
    class_counts: np.ndarray
    input_kind: str = "image"
    input_shape: tuple[int, ...] = ()
    vocab_size: int = 0
    dataset: str = ""
    """The dataset's name; for a converted PFLlib directory, that directory's name."""
    pfllib_dir: str = ""
    """The PFLlib directory the cache was converted from (absolute); "" for a split drawn here."""

    @property
    def identity(self) -> str:
        """What the clients train on, as a name: the cache file's stem, whose hash covers the
        source files' fingerprint and every key that shapes the split. A checkpoint keeps it, so a
        resume that would read other data is noticed (the data's location is not part of it)."""
        return os.path.splitext(os.path.basename(self.path))[0]

    def inputs(self) -> InputSpec:
        """One sample's kind and shape (square pictures when ``input_shape`` was not given)."""
        if not self.input_shape:
            return InputSpec.image(self.in_channels, self.image_size)
        return InputSpec(self.input_kind, self.input_shape, self.vocab_size)  # type: ignore[arg-type]

    def describe(self) -> str:
        """Where the data come from, for start-up lines: ``fmnist``, or ``PFLlib directory
        /data/Cifar10`` (``data.dataset`` names nothing that is read when the split comes from
        a PFLlib directory, so the config's dataset name would mislead there)."""
        if self.pfllib_dir:
            return f"PFLlib directory {self.pfllib_dir}"
        return self.dataset or "data of unrecorded origin"


@dataclass
class ClientSplit:
    """One logical client's data, ready for training: x float32 normalised, y int64."""

    client_id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


ClientArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""One client's (train_x, train_y, test_x, test_y), as :func:`write_cache` stores them."""


# --------------------------------------------------------------------------- writing


def _open_read(path: str) -> h5py.File:
    """Open read-only without HDF5 file locking (caches are immutable once renamed into
    place, and locking fails on some cluster filesystems)."""
    try:
        return h5py.File(path, "r", locking=False)
    except TypeError:  # very old h5py without the keyword
        return h5py.File(path, "r")


def is_complete(path: str, key_json: str) -> bool:
    """Whether ``path`` is a finished cache of this format built for exactly ``key_json``."""
    try:
        with _open_read(path) as f:
            return (
                bool(f.attrs.get("complete", False))
                and int(f.attrs.get("format_version", -1)) == FORMAT_VERSION
                and str(f.attrs.get("key_json", "")) == key_json
            )
    except (OSError, KeyError, ValueError):
        return False


def write_cache(
    path: str,
    attrs: dict,
    num_clients: int,
    num_classes: int,
    client_arrays: Callable[[int], ClientArrays],
) -> None:
    """Write every client's arrays to a temp file beside ``path``, then rename atomically.

    ``client_arrays`` is called once per client, in client order, so a caller can stream a
    large dataset; it may still add to ``attrs`` (they are written after the clients)."""
    try:
        with replaced_atomically(path) as tmp:
            _write_clients(tmp, attrs, num_clients, num_classes, client_arrays)
    except (OSError, OutputError) as exc:
        raise DataError(
            f"cannot write the partition cache {path}: {exc}; set data.cache_dir=DIR to a writable directory "
            f"with free space"
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
                dataset=str(f.attrs.get("dataset", "")),
                pfllib_dir=_pfllib_dir(f.attrs),
            )
    except (OSError, KeyError) as exc:
        raise DataError(f"cannot read partition cache {path} ({exc}); delete it so it is rebuilt") from None


def _pfllib_dir(attrs: h5py.AttributeManager) -> str:
    """The directory a PFLlib conversion read, from the key the cache was built for."""
    if str(attrs.get("partition", "")) != "pfllib":
        return ""
    try:
        return str(json.loads(str(attrs.get("key_json", "{}"))).get("directory", ""))
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        return ""


def _to_tensor(x: np.ndarray, x_format: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(x))
    if x_format == "tokens":
        return tensor.long()
    if x_format == "uint8":
        # PFLlib: ToTensor (x / 255) then Normalize(mean 0.5, std 0.5) on every channel.
        # in place after the one conversion: the same three roundings without two more buffers
        return tensor.float().div_(255.0).sub_(0.5).div_(0.5)
    return tensor.float()


def few_shot_rows(labels: torch.Tensor, shots: int) -> torch.Tensor:
    """The rows a ``shots``-shot training split keeps, in their stored order: the first ``shots``
    of each class (all of a class that has fewer), as HtFLlib's and PFLlib's ``read_client_data``
    walks the split counting each label (``-fs``)."""
    count = labels.shape[0]
    order = torch.sort(labels, stable=True).indices  # each class's rows together, in stored order
    ranked = labels[order]
    starts = torch.ones(count, dtype=torch.bool)
    starts[1:] = ranked[1:] != ranked[:-1]
    first_of_class = torch.cummax(torch.where(starts, torch.arange(count), 0), dim=0).values
    rank = torch.empty(count, dtype=torch.int64)
    rank[order] = torch.arange(count) - first_of_class  # each row's place among its class's rows
    return torch.nonzero(rank < shots).flatten()


def with_few_shot(info: PartitionInfo, shots: int) -> PartitionInfo:
    """``info`` with the class counts of ``shots``-shot training splits (what placement weighs
    clients by); itself when ``shots`` is 0."""
    if not shots:
        return info
    return dataclasses.replace(info, class_counts=np.minimum(info.class_counts, shots))


def load_client_split(path: str, client_id: int, few_shot: int = 0) -> ClientSplit:
    """Read only ``client_<client_id>`` from the cache and return normalised tensors; with
    ``few_shot`` k > 0 (``data.few_shot``) the training split keeps k samples per class
    (``few_shot_rows``) and the test split is untouched."""
    (split,) = load_client_splits(path, [client_id], few_shot)
    return split


def load_client_splits(path: str, client_ids: Sequence[int], few_shot: int = 0) -> list[ClientSplit]:
    """:func:`load_client_split` for each of ``client_ids``, through one open file: a rank hosting
    1,000 clients opened the cache 1,000 times, 10 ms each."""
    reading = "the file"
    try:
        with _open_read(path) as f:
            num_clients = int(f.attrs["num_clients"])
            x_format = str(f.attrs.get("x_format", "uint8"))
            raw = []
            for client_id in client_ids:
                reading = f"client {client_id}"
                if not 0 <= client_id < num_clients:
                    raise DataError(
                        f"partition cache {path} holds clients 0..{num_clients - 1}, not {client_id}"
                    )
                group = f[f"client_{client_id}"]
                raw.append({name: group[name][()] for name in ("train_x", "train_y", "test_x", "test_y")})
    except (OSError, KeyError) as exc:
        raise DataError(f"cannot read {reading} from partition cache {path} ({exc}); "
                        f"delete the file so it is rebuilt") from None
    return [_client_split(client_id, arrays, x_format, few_shot)
            for client_id, arrays in zip(client_ids, raw, strict=True)]


def load_test_union(path: str, client_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The test splits of ``client_ids`` concatenated in client-id order (``eval.test_set=global``:
    the global test set every client is tested on), read without their training splits."""
    reading = "the file"
    try:
        with _open_read(path) as f:
            x_format = str(f.attrs.get("x_format", "uint8"))
            xs, ys = [], []
            for client_id in sorted(client_ids):
                reading = f"client {client_id}"
                group = f[f"client_{client_id}"]
                xs.append(_to_tensor(group["test_x"][()], x_format))
                ys.append(torch.from_numpy(group["test_y"][()].astype(np.int64)))
    except (OSError, KeyError) as exc:
        raise DataError(f"cannot read {reading} from partition cache {path} ({exc}); "
                        f"delete the file so it is rebuilt") from None
    return torch.cat(xs), torch.cat(ys)


def _client_split(client_id: int, arrays: dict[str, np.ndarray], x_format: str, few_shot: int) -> ClientSplit:
    train_y = torch.from_numpy(arrays["train_y"].astype(np.int64))
    train_x = _to_tensor(arrays["train_x"], x_format)
    if few_shot > 0:
        kept = few_shot_rows(train_y, few_shot)
        train_x, train_y = train_x[kept], train_y[kept]
    return ClientSplit(
        client_id=client_id,
        train_x=train_x,
        train_y=train_y,
        test_x=_to_tensor(arrays["test_x"], x_format),
        test_y=torch.from_numpy(arrays["test_y"].astype(np.int64)),
    )
