"""CIFAR-shaped generated pictures for the pfl comparison (bench/pfl_side_by_side.py): numpy
only, so the pfl runner (in pfl's own venv, without htfl_dist) and our plugin
(bench/pfl_workload.py) draw the very same images from the same seed. Nothing is downloaded.

Each class has a fixed random 3 x 32 x 32 template; a sample is its template plus uniform noise,
so the classes are learnable (a run's accuracy means something) and the pixel values are spread
like real pictures' (no denormal or constant inputs that would make a step cheaper)."""
from __future__ import annotations

import numpy as np

CLASSES = 10
SHAPE = (3, 32, 32)
"""CIFAR-10's: 10 classes of 3 x 32 x 32 pictures (pfl's benchmark workload)."""
NOISE = 64
"""Half-width of the uniform pixel noise around the class template (of 0..255)."""
CHUNK = 4096
"""Samples drawn at once: bounds the transient int16 buffer (4096 x 3072 x 2 B = 24 MiB)."""


def balanced_labels(per_class: int) -> np.ndarray:
    """``per_class`` samples of each class, class by class (0,0,..,1,1,..): balanced pathological
    partitions cut each class in index order, so every client gets per_class / clients of each."""
    return np.repeat(np.arange(CLASSES, dtype=np.int64), per_class)


def draw_images(labels: np.ndarray, seed: int) -> np.ndarray:
    """uint8 pictures N x 3 x 32 x 32 for ``labels``, a pure function of (labels, seed)."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(NOISE, 256 - NOISE, size=(CLASSES, *SHAPE), dtype=np.int16)
    images = np.empty((labels.shape[0], *SHAPE), dtype=np.uint8)
    for start in range(0, labels.shape[0], CHUNK):
        rows = labels[start:start + CHUNK]
        noise = rng.integers(-NOISE, NOISE + 1, size=(rows.shape[0], *SHAPE), dtype=np.int16)
        images[start:start + CHUNK] = np.clip(templates[rows] + noise, 0, 255).astype(np.uint8)
    return images


def normalised(images: np.ndarray) -> np.ndarray:
    """float32 (x / 255 − 0.5) / 0.5, the scaling htfl_dist applies to uint8 pictures (PFLlib's
    ToTensor + Normalize(0.5, 0.5)), so every side trains on the same values."""
    return ((images.astype(np.float32) / np.float32(255.0)) - np.float32(0.5)) / np.float32(0.5)
