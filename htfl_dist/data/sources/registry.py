"""The dataset registry: name -> :class:`DatasetSource` (its class count, files, fingerprint, loader).

Each source module (``fmnist``, ``cifar``, ``tinyimagenet``, ``flowers102``) registers its own
datasets with :func:`register_dataset` when it is imported; ``htfl_dist.data.sources`` imports
them all, so the allowed names are exactly what was registered, in registration order. A
config string is only ever looked up here (never ``eval``-ed, never resolved with ``getattr``),
under the one name rule of :mod:`htfl_dist.registry`, so an unknown name is a one-line
:class:`~htfl_dist.errors.ConfigError` listing the allowed ones.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from htfl_dist.registry import Registry


@dataclass
class DatasetArrays:
    """A whole dataset in memory: ``images`` uint8 N x C x H x W, ``labels`` int64 N."""

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
    load: Callable[[str | None], DatasetArrays]
    """All labelled samples, train and test parts concatenated."""
    fingerprint: Callable[[str | None], list[list]] | None = None
    """A cheap fingerprint of the source, part of the partition cache key; None: the name,
    size and mtime of each of ``files`` (:func:`stat_fingerprint`)."""
    default_root: str | None = None
    """The root used when ``data.root`` is unset (None: the dataset needs ``data.root``)."""

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
