"""Domain suites: datasets made of several domains that share one label space (Digit-5, DomainNet).

A suite is a registered dataset (``data.dataset: digit5`` reads every domain, pooled) that can
also be read one domain at a time, which ``data.domains`` does (:mod:`htfl_dist.data.prepare`):
client i gets domain i mod D and each domain's samples are split among its own clients. Each
domain is read from the raw per-domain files PFLlib's generator reads (``generate_Digit5.py``,
``generate_DomainNet.py``) and brought to the suite's one input shape (uint8 3 x S x S: grey
domains get three equal channels, other sizes are resized with PIL's bilinear filter, as
torchvision's ``Resize`` on a PIL image does) while the partition cache is built, not at train
time.

A domain that is asked for but missing, or whose label set differs from the other domains', is
a one-line :class:`~htfl_dist.errors.ConfigError` naming ``data.domains``.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from htfl_dist.errors import ConfigError, DataError
from htfl_dist.registry import Registry

from .registry import DatasetArrays, DatasetSource, register_dataset


@dataclass(frozen=True)
class DomainSuite:
    """How the domains of one dataset are found, fingerprinted and read."""

    name: str
    domains: tuple[str, ...]
    """Every domain, in the order ``data.dataset`` alone pools them (PFLlib's generator order)."""
    num_classes: int
    """The nominal label space (every domain's labels lie in 0 .. num_classes - 1)."""
    image_size: int
    """Side S of the uint8 3 x S x S pictures every domain is brought to."""
    files: Callable[[str, str], list[str]]
    """(folder, domain) -> the files the domain is read from; ConfigError naming what is missing."""
    load: Callable[[str, str], tuple[np.ndarray, np.ndarray]]
    """(folder, domain) -> (images uint8 N x 3 x S x S, labels int64 N), train then test."""
    folder: Callable[[str | None], str]
    """data.root -> the folder holding the domains (a one-line error when there is none)."""
    fingerprint: Callable[[str, str], list[list]]
    """(folder, domain) -> a cheap fingerprint, part of the partition cache key."""
    get: str
    """How to obtain the data (said when a domain is missing)."""


_SUITES: Registry[DomainSuite] = Registry("domain suite", "data.dataset", plumbing=(__name__,))


def domain_suite_names() -> list[str]:
    return _SUITES.names()


def domain_suite(dataset: str) -> DomainSuite:
    """The suite registered as ``dataset``; a one-line ConfigError for a dataset without domains."""
    suite = _SUITES.find(dataset)
    if suite is None:
        raise ConfigError(
            f"config key 'data.domains' is set but data.dataset {dataset!r} has no domains; datasets "
            f"with domains: {', '.join(_SUITES.names())} (docs/datasets.md, \"Domain shift\")"
        )
    return suite


def check_domains(suite: DomainSuite, domains: list[str], num_clients: int) -> list[str]:
    """The asked-for domains, checked: known to the suite, no repeats, at least one client each."""
    unknown = [d for d in domains if d not in suite.domains]
    if unknown:
        raise ConfigError(
            f"config key 'data.domains' names {unknown[0]!r}, not a domain of {suite.name}; its domains: "
            f"{', '.join(suite.domains)}"
        )
    repeated = sorted({d for d in domains if domains.count(d) > 1})
    if repeated:
        raise ConfigError(f"config key 'data.domains' names {repeated[0]!r} twice; name each domain once")
    if num_clients < len(domains):
        raise ConfigError(
            f"config key 'num_clients' is {num_clients} but data.domains names {len(domains)} domains; "
            f"client i gets domain i mod {len(domains)}, so use at least {len(domains)} clients"
        )
    return list(domains)


def domain_of_client(num_clients: int, num_domains: int) -> list[int]:
    """Client i's domain: i mod D (PFLlib's domain benchmarks give client i domain i)."""
    return [cid % num_domains for cid in range(num_clients)]


def suite_root(root: str | None, dataset: str, holds: str, get: str) -> str:
    """The folder a suite's domains are read from: ``data.root`` (or its PFLlib ``rawdata/``),
    which must be a directory; otherwise one line saying what the directory holds and how to get
    it (``dataset``: the suite's name for the reader, ``holds``: what the directory holds)."""
    if not root:
        raise DataError(f"data.dataset={dataset} needs data.root=DIR, a directory holding {holds} "
                        f"({get}; nothing is downloaded)")
    if not os.path.isdir(root):
        raise DataError(f"{dataset} not found: {root} is not a directory; set data.root=DIR where DIR holds "
                        f"{holds} ({get})")
    return under_rawdata(root)


def missing_domain(suite: DomainSuite, folder: str, domain: str, missing: list[str]) -> ConfigError:
    return ConfigError(
        f"{suite.name} domain {domain!r} is missing: {folder} lacks {', '.join(missing)}; {suite.get} "
        f"(data.root=DIR), or leave {domain!r} out of data.domains"
    )


def load_domains(suite: DomainSuite, folder: str, domains: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each domain's (images, labels), read and checked: one shape, one label set for all."""
    out = []
    for domain in domains:
        images, labels = suite.load(folder, domain)
        expected = (3, suite.image_size, suite.image_size)
        if images.dtype != np.uint8 or images.shape[1:] != expected or images.shape[0] != labels.shape[0]:
            raise ConfigError(f"{suite.name} domain {domain!r} was read as {images.dtype} "
                              f"{images.shape}, not uint8 N x {' x '.join(map(str, expected))}")
        if labels.size and (labels.min() < 0 or labels.max() >= suite.num_classes):
            raise ConfigError(
                f"{suite.name} domain {domain!r} holds label {int(labels.max())}, outside "
                f"{suite.name}'s 0..{suite.num_classes - 1}; fix the data, or leave {domain!r} out of data.domains"
            )
        out.append((images, labels.astype(np.int64)))
    label_sets = [np.unique(labels) for _, labels in out]
    for domain, found in zip(domains, label_sets, strict=True):
        if not np.array_equal(found, label_sets[0]):
            raise ConfigError(
                f"{suite.name} domain {domain!r} holds labels {_label_set(found)} but {domains[0]!r} holds "
                f"{_label_set(label_sets[0])}; the domains must share one label set (fix the data, or leave "
                f"{domain!r} out of data.domains)"
            )
    return out


def _label_set(labels: np.ndarray) -> str:
    values = [int(v) for v in labels]
    if values and values == list(range(values[0], values[-1] + 1)) and len(values) > 3:
        return f"{values[0]}..{values[-1]}"
    return "{" + ", ".join(map(str, values)) + "}"


def to_rgb_square(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 N x C x H x W (C = 1 or 3) -> uint8 N x 3 x size x size: grey repeated over three
    channels, other sizes resized with PIL's bilinear filter (torchvision's ``Resize`` on PIL)."""
    if images.shape[1] == 1:
        images = np.repeat(images, 3, axis=1)
    if images.shape[1] != 3:
        raise ValueError(f"pictures of {images.shape[1]} channels")
    if images.shape[2:] == (size, size):
        return np.ascontiguousarray(images)
    from PIL import Image

    bilinear = getattr(Image, "Resampling", Image).BILINEAR
    out = np.empty((images.shape[0], 3, size, size), dtype=np.uint8)
    for i, image in enumerate(images):
        picture = Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0)))
        out[i] = np.asarray(picture.resize((size, size), bilinear), dtype=np.uint8).transpose(2, 0, 1)
    return out


def as_uint8(values: np.ndarray) -> np.ndarray:
    """Pixel values 0..255 (any numeric dtype) as uint8, cut as PFLlib's ``np.uint8(...)`` cuts."""
    if values.dtype == np.uint8:
        return values
    return np.clip(np.asarray(values, dtype=np.float64), 0, 255).astype(np.uint8)


def register_suite(suite: DomainSuite) -> None:
    """Register ``suite`` as a domain suite and as a dataset (every domain pooled, in order)."""
    _SUITES.add(suite.name, suite)

    def files(root: str | None) -> list[str]:
        folder = suite.folder(root)
        return [path for domain in suite.domains for path in suite.files(folder, domain)]

    def load(root: str | None) -> DatasetArrays:
        folder = suite.folder(root)
        parts = load_domains(suite, folder, list(suite.domains))
        return DatasetArrays(
            images=np.concatenate([images for images, _ in parts]),
            labels=np.concatenate([labels for _, labels in parts]),
            num_classes=suite.num_classes,
            name=suite.name,
        )

    def fingerprint(root: str | None) -> list[list]:
        folder = suite.folder(root)
        return [entry for domain in suite.domains for entry in suite.fingerprint(folder, domain)]

    register_dataset(DatasetSource(name=suite.name, num_classes=suite.num_classes, files=files, load=load,
                                   fingerprint=fingerprint))


def under_rawdata(root: str) -> str:
    """``root``, or its ``rawdata/`` when ``root`` is the dataset directory PFLlib's generator made."""
    raw = os.path.join(root, "rawdata")
    return raw if os.path.isdir(raw) else root
