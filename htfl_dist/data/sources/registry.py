"""The dataset registry: name -> :class:`DatasetSource` (its class count, files, fingerprint, loader).

Each source module (``fmnist``, ``cifar``, ``tinyimagenet``, ``flowers102``) registers its own
datasets with :func:`register_dataset` when it is imported; ``htfl_dist.data.sources`` imports
them all, so the allowed names are exactly what was registered, in registration order. A
config string is only ever looked up here (never ``eval``-ed, never resolved with ``getattr``),
under the one name rule of :mod:`htfl_dist.registry`, so an unknown name is a one-line
:class:`~htfl_dist.errors.ConfigError` listing the allowed ones.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from htfl_dist.config.loading import checked_section
from htfl_dist.errors import ConfigError, DataError, shown
from htfl_dist.registry import Registry


@dataclass
class DatasetArrays:
    """A whole dataset in memory: ``labels`` int64 N and the samples ``images`` (named for the
    first kind it held), one of

    - uint8 N x C x H x W pictures (normalised as PFLlib does: x / 255, then (x - 0.5) / 0.5);
    - float32 N x C x H x W or N x F numbers (sensor windows, tabular features), used as they are;
    - int64 N x (L + 1) text rows: L token ids, then the row's length in 1..L (PFLlib's text
      rows, what the text models read), the ids in 0 .. vocab_size - 1.

    :func:`check_arrays` holds a source's arrays to this before anything is split."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str


@dataclass(frozen=True)
class DatasetSource:
    """How one dataset is found, fingerprinted and read. Every callable takes the root already
    resolved (``default_root`` where the config leaves ``data.root`` unset)."""

    name: str
    num_classes: int
    """The dataset's nominal class count, known before any file is read (``data.classes_per_client``
    is checked against it); the loaded :class:`DatasetArrays` carries the count actually read."""
    files: Callable[[str | None], list[str]]
    """The files ``load`` reads (for image folders: metadata files and directories, not every
    image); raises the same DataError as ``load`` when they are missing."""
    load: Callable[..., DatasetArrays]
    """All labelled samples, train and test parts concatenated: ``load(root)``, or
    ``load(root, options)`` with the resolved ``options`` instance where the source declares them."""
    fingerprint: Callable[[str | None], list[list]] | None = None
    """A cheap fingerprint of the source, part of the partition cache key; None: the name,
    size and mtime of each of ``files`` (:func:`stat_fingerprint`)."""
    default_root: str | None = None
    """The root used when ``data.root`` is unset (None: the dataset needs ``data.root``)."""
    options: type | None = None
    """A dataclass of the dataset's own options (``data.options.*``, declared with ``bounded`` /
    ``Literal`` like an algorithm's), or None: the dataset takes none and ``data.options`` must
    be empty."""

    def resolve_root(self, root: str | None) -> str | None:
        """``root``, else ``default_root`` (None where the dataset has none)."""
        return root or self.default_root


_DATASETS: Registry[DatasetSource] = Registry("dataset", "data.dataset", plumbing=(__name__, f"{__package__}.domains"))
"""In registration order; a domain suite registers its dataset from ``domains``, so the source a
duplicate names is the suite's module."""


def register_dataset(source: DatasetSource) -> DatasetSource:
    """Register ``source`` under ``source.name`` (the one name rule of ``htfl_dist.registry``)."""
    return _DATASETS.add(source.name, source)


def dataset_names() -> list[str]:
    """All registered dataset names, in registration order (the order error messages list)."""
    return _DATASETS.names()


def dataset_source(name: str) -> DatasetSource:
    """The registered source of ``name``; a one-line ConfigError listing the allowed names."""
    return _DATASETS.get(name)


def stat_fingerprint(paths: list[str]) -> list[list]:
    """[file name, size, mtime in ns] of each of ``paths`` (the default fingerprint)."""
    out = []
    for path in paths:
        stat = os.stat(path)
        out.append([os.path.basename(path), int(stat.st_size), int(stat.st_mtime_ns)])
    return out


def dataset_options(source: DatasetSource, raw: dict[str, Any]) -> Any:
    """``data.options`` as ``source``'s options dataclass (checked: names, types, bounds, its
    ``validate``), or None for a source without options (then ``raw`` must be empty)."""
    if source.options is None:
        if raw:
            raise ConfigError(f"config key 'data.options' is {shown(raw)} but dataset {source.name!r} takes no "
                              f"options; leave data.options empty")
        return None
    return checked_section(source.options, raw, "data.options.")


def spelled_out_dataset_options(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``data.options`` checked and with every option written out (empty for a source without
    options): the form a config is stored, hashed and keyed in."""
    options = dataset_options(dataset_source(name), raw)
    return {} if options is None else dataclasses.asdict(options)


MAX_TEXT_LENGTH = 1 << 16
"""The longest text row a source may hand over (ids per sample)."""


def check_arrays(arrays: DatasetArrays, vocab_cap: int) -> str:
    """The arrays' input format ("uint8", "float32" or "tokens", the partition cache's
    ``x_format``), after holding them to :class:`DatasetArrays`' rules: one line naming the
    dataset and what is wrong otherwise (a plugin's loader is not trusted to get it right)."""
    x, y, where = arrays.images, arrays.labels, f"dataset {arrays.name!r}"
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise DataError(f"{where}: images and labels must be numpy arrays")
    if y.ndim != 1 or y.shape[0] != x.shape[0] or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where}: labels must be integers, one per sample (labels {y.shape} {y.dtype}, "
                        f"images {x.shape})")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= arrays.num_classes):
        raise DataError(f"{where}: labels must lie in 0..{arrays.num_classes - 1}, found {int(y.min())}.."
                        f"{int(y.max())}")
    if x.dtype == np.uint8 and x.ndim == 4:
        return "uint8"
    if x.dtype == np.float32 and x.ndim in (2, 4):
        if x.size and not np.isfinite(x).all():
            raise DataError(f"{where}: the float samples hold NaN or Inf")
        return "float32"
    if x.dtype == np.int64 and x.ndim == 2 and 2 <= x.shape[1] <= MAX_TEXT_LENGTH + 1:
        ids, lengths = x[:, :-1], x[:, -1]
        if x.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_cap):
            raise DataError(f"{where}: token ids must lie in 0..{vocab_cap - 1}")
        if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
            raise DataError(f"{where}: a text row's last column is its length, in 1..{ids.shape[1]}")
        return "tokens"
    raise DataError(f"{where}: samples are {x.dtype} {x.shape}; supported: uint8 N x C x H x W pictures, float32 "
                    f"N x C x H x W or N x F numbers, or int64 N x (L + 1) text rows (ids, then the length)")
