"""``shapes4``: four classes of 16x16 grey images (square, cross, ring, bar), stored as one
``shapes4.npz`` (``images`` uint8 N x 1 x 16 x 16, ``labels`` int64 N) under ``data.root``."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from htfl_dist.api import DataError, DatasetArrays, DatasetSource, register_dataset

FILE_NAME = "shapes4.npz"
CLASSES = 4
SIDE = 16


def _file(root: str | None) -> str:
    if not root:
        raise DataError("dataset shapes4 needs data.root=DIR holding shapes4.npz (write_shapes4(DIR) draws one)")
    path = os.path.join(root, FILE_NAME)
    if not os.path.isfile(path):
        raise DataError(f"dataset shapes4: no {path}; write one with htfl_example_plugin.write_shapes4")
    return path


def load_shapes4(root: str | None) -> DatasetArrays:
    with np.load(_file(root), allow_pickle=False) as data:
        images, labels = data["images"], data["labels"].astype(np.int64)
    if images.dtype != np.uint8 or images.shape[1:] != (1, SIDE, SIDE) or labels.shape != images.shape[:1]:
        raise DataError(f"dataset shapes4: {FILE_NAME} must hold uint8 images N x 1 x {SIDE} x {SIDE} and N labels")
    return DatasetArrays(images=images, labels=labels, num_classes=CLASSES, name="shapes4")


register_dataset(DatasetSource(name="shapes4", num_classes=CLASSES, files=lambda root: [_file(root)],
                               load=load_shapes4))


def _shape(label: int, rng: np.random.Generator) -> np.ndarray:
    canvas = np.zeros((SIDE, SIDE), dtype=np.float64)
    low, high = rng.integers(2, 5), rng.integers(11, 14)
    if label == 0:  # filled square
        canvas[low:high, low:high] = 1
    elif label == 1:  # cross
        canvas[SIDE // 2 - 1 : SIDE // 2 + 1, low:high] = 1
        canvas[low:high, SIDE // 2 - 1 : SIDE // 2 + 1] = 1
    elif label == 2:  # ring
        y, x = np.mgrid[:SIDE, :SIDE]
        radius = np.hypot(y - 7.5, x - 7.5)
        canvas[(radius > 3) & (radius < 6)] = 1
    else:  # horizontal bar
        canvas[6:10, low:high] = 1
    return canvas


def write_shapes4(root: str | os.PathLike[str], samples: int = 2000, seed: int = 0) -> Path:
    """Draw ``samples`` noisy shapes (balanced classes) into ``root/shapes4.npz``; returns the path."""
    rng = np.random.default_rng(seed)
    labels = np.arange(samples, dtype=np.int64) % CLASSES
    rng.shuffle(labels)
    images = np.stack([_shape(int(label), rng) for label in labels])
    images = np.clip(images * 200 + rng.normal(0, 30, images.shape), 0, 255).astype(np.uint8)[:, None]
    path = Path(root) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, images=images, labels=labels)
    return path
