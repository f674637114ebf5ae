"""Dataset entry points: whole datasets as uint8 image arrays, read from local files only.

A thin facade over the dataset registry (:mod:`htfl_dist.data.sources`): each dataset is one
module there that registers a :class:`~htfl_dist.data.sources.DatasetSource`, and the functions
below look the name up and call it. Nothing here downloads. Fashion-MNIST comes from IDX files
(the Debian package ``dataset-fashion-mnist`` installs them under
``/usr/share/datasets/fashion-mnist``); CIFAR-10/100 come from a torchvision-layout root;
Tiny-ImageNet from the extracted ``tiny-imagenet-200.zip`` and Flowers102 from torchvision's
``flowers-102`` folder (JPEGs, decoded once into uint8 arrays; afterwards the HDF5 partition
cache is read). Train and test parts are concatenated, as PFLlib does: the federated split is
made from all samples.
"""
from __future__ import annotations

from typing import Any

from htfl_dist.config import DataConfig

from .sources import (
    DatasetArrays,
    DatasetSource,
    dataset_names,
    dataset_options,
    dataset_source,
    register_dataset,
    stat_fingerprint,
)
from .sources.flowers102 import flowers102_files
from .sources.fmnist import FMNIST_FILES, fmnist_files, parse_idx
from .sources.jpeg import decode_images
from .sources.tinyimagenet import tinyimagenet_files

__all__ = [
    "FMNIST_FILES",
    "DatasetArrays",
    "DatasetSource",
    "dataset_files",
    "dataset_fingerprint",
    "dataset_names",
    "dataset_root",
    "dataset_source",
    "decode_images",
    "flowers102_files",
    "fmnist_files",
    "load_dataset",
    "parse_idx",
    "register_dataset",
    "tinyimagenet_files",
]


def dataset_root(data: DataConfig) -> str | None:
    """The directory the dataset is read from: ``data.root``, else the dataset's default root
    (fmnist: the OS package's directory; the other datasets have none and say so when they are
    read without one)."""
    return dataset_source(data.dataset).resolve_root(data.root)


def dataset_files(name: str, root: str | None) -> list[str]:
    """The files ``load_dataset`` would read (raises the same DataError when missing).

    For the JPEG datasets: their metadata files and image directories, not every image.
    """
    source = dataset_source(name)
    return source.files(source.resolve_root(root))


def dataset_fingerprint(name: str, root: str | None) -> list[list]:
    """A cheap fingerprint of the source, part of the partition cache key.

    FMNIST / CIFAR: (file name, size, mtime in ns) of each source file.

    Tiny-ImageNet (110,000 JPEGs) and Flowers102 (8,189): stat-ing every image would cost
    minutes on a cluster file system, and every rank computes this key at every start. So the
    fingerprint covers the metadata files (wnids.txt, val_annotations.txt, imagelabels.mat,
    setid.mat: name, size, mtime) and each image directory's entry count and mtime (one listing
    per directory, no stat per file; the 200 Tiny-ImageNet class folders are folded into one
    digest), plus the preprocessing (RGB, output size, resize filter). Adding, removing or
    renaming an image changes its directory's mtime and usually its count, so the cache is
    rebuilt; an image overwritten in place under the same name is not noticed: delete the
    partition cache (data.cache_dir) after editing images in place. Paths are relative to the
    dataset folder, so a moved copy of the same data reuses its cache.
    """
    source = dataset_source(name)
    root = source.resolve_root(root)
    if source.fingerprint is None:
        return stat_fingerprint(source.files(root))
    return source.fingerprint(root)


def load_dataset(name: str, root: str | None, options: dict[str, Any] | None = None) -> DatasetArrays:
    """Load all labelled samples of ``name`` from ``root`` (fmnist default: the OS package dir),
    with its ``data.options`` where the source declares options.

    FMNIST / CIFAR: train + test; Tiny-ImageNet: train + val; Flowers102: train + val + test.
    """
    source = dataset_source(name)
    declared = dataset_options(source, options or {})
    root = source.resolve_root(root)
    return source.load(root) if declared is None else source.load(root, declared)
