"""Two plugin datasets as a user writes them, outside the package, reading files from the
directory the config names (``data.root``): float features with an option of their own
(``data.options.columns``), and text rows of token ids. The suite registers them into a scratch
copy of the dataset registry (tests/data/test_plugin_datasets.py), never into the real one."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from htfl_dist.api import DataError, DatasetArrays, DatasetSource, bounded

FEATURES_FILE = "features.npz"
TOKENS_FILE = "tokens.npz"


@dataclass
class FeatureOptions:
    columns: int = bounded(6, at_least=1, at_most=64)
    """The first k feature columns the clients see."""


def _path(root: str | None, name: str) -> str:
    if not root:
        raise DataError("this dataset needs data.root=DIR")
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing")
    return path


def load_features(root: str | None, options: FeatureOptions) -> DatasetArrays:
    with np.load(_path(root, FEATURES_FILE)) as archive:
        x, y = archive["x"][:, :options.columns], archive["y"]
    return DatasetArrays(images=np.ascontiguousarray(x), labels=y, num_classes=4, name="plugin_features")


def load_tokens(root: str | None) -> DatasetArrays:
    with np.load(_path(root, TOKENS_FILE)) as archive:
        return DatasetArrays(images=archive["x"], labels=archive["y"], num_classes=3, name="plugin_tokens")


FEATURES = DatasetSource(name="plugin_features", num_classes=4, files=lambda root: [_path(root, FEATURES_FILE)],
                         load=load_features, options=FeatureOptions)
TOKENS = DatasetSource(name="plugin_tokens", num_classes=3, files=lambda root: [_path(root, TOKENS_FILE)],
                       load=load_tokens)


def write_features(root: str, samples: int = 400) -> np.ndarray:
    """Four Gaussian blobs in 64 dimensions, the class mean in its own columns; returns x."""
    rng = np.random.default_rng(0)
    y = np.arange(samples) % 4
    x = rng.normal(0.0, 0.3, (samples, 64)).astype(np.float32)
    x[np.arange(samples), y] += 2.0
    np.savez(os.path.join(root, FEATURES_FILE), x=x, y=y.astype(np.int64))
    return x


def write_tokens(root: str, samples: int = 300, length: int = 12, vocab: int = 50) -> np.ndarray:
    """Class c's rows draw their ids from c's third of the vocabulary; the last column is the length."""
    rng = np.random.default_rng(1)
    y = np.arange(samples) % 3
    ids = rng.integers(0, vocab // 3, (samples, length)) + (vocab // 3) * y[:, None]
    lengths = rng.integers(4, length + 1, samples)
    x = np.concatenate([ids, lengths[:, None]], axis=1).astype(np.int64)
    np.savez(os.path.join(root, TOKENS_FILE), x=x, y=y.astype(np.int64))
    return x
