"""Fashion-MNIST from its four IDX files (gzip or plain), as the Debian package
``dataset-fashion-mnist`` installs them under ``/usr/share/datasets/fashion-mnist`` (the default
root). Train and test parts are concatenated."""
from __future__ import annotations

import gzip
import math
import os
import zlib

import numpy as np

from htfl_dist.config import DEFAULT_FMNIST_ROOT
from htfl_dist.errors import DataError

from .registry import DatasetArrays, DatasetSource, register_dataset

FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

_IDX_UBYTE = 0x08


def _find_idx_file(root: str, stem: str) -> str | None:
    """The plain file if present, else the ``.gz`` one, else None."""
    for candidate in (stem, stem + ".gz"):
        path = os.path.join(root, candidate)
        if os.path.isfile(path):
            return path
    return None


def fmnist_files(root: str | None) -> list[str]:
    """Paths of the four IDX files under ``root``; DataError naming what is missing."""
    if root is None or not os.path.isdir(root):
        raise DataError(
            f"Fashion-MNIST not found at {root}: install it with `apt-get install "
            f"dataset-fashion-mnist` or set data.root=DIR holding train-images-idx3-ubyte.gz, "
            f"train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz"
        )
    found, missing = [], []
    for stem in FMNIST_FILES:
        path = _find_idx_file(root, stem)
        if path is None:
            missing.append(stem + "(.gz)")
        else:
            found.append(path)
    if missing:
        raise DataError(
            f"Fashion-MNIST directory {root} lacks {', '.join(missing)}: install "
            f"`dataset-fashion-mnist` or set data.root=DIR holding the four IDX files"
        )
    return found


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            head = handle.read(2)
            handle.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=handle) as unzipped:
                    return unzipped.read()
            return handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a truncated stream raises EOFError.
        raise DataError(
            f"cannot read {path} ({type(exc).__name__}: {exc}); the file is corrupt or "
            f"truncated: reinstall `dataset-fashion-mnist` or replace the file"
        ) from None


def parse_idx(path: str, expected_ndim: int) -> np.ndarray:
    """Parse an IDX file of unsigned bytes (gzip or plain) into a uint8 array."""
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path} is not an IDX file (only {len(raw)} bytes); replace the file")
    zero, dtype_code, ndim = int.from_bytes(raw[0:2], "big"), raw[2], raw[3]
    if zero != 0 or dtype_code != _IDX_UBYTE or ndim != expected_ndim:
        magic = int.from_bytes(raw[0:4], "big")
        want = (_IDX_UBYTE << 8) | expected_ndim
        raise DataError(
            f"{path} has IDX magic number 0x{magic:08x}, expected 0x{want:08x} "
            f"(unsigned bytes, {expected_ndim} dims); the file is not the expected IDX file"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated inside its IDX header; replace the file")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = math.prod(dims) if dims else 0  # Python ints: four 32-bit dims overflow int64
    body = len(raw) - header
    if body != expected:
        raise DataError(
            f"{path} holds {body} data bytes but its IDX header {dims} needs {expected}; "
            f"the file is truncated or corrupt: replace it"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_fmnist(root: str | None) -> DatasetArrays:
    train_x, train_y, test_x, test_y = fmnist_files(root)
    images, labels = [], []
    for img_path, lab_path in ((train_x, train_y), (test_x, test_y)):
        x = parse_idx(img_path, 3)
        y = parse_idx(lab_path, 1)
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"{img_path} holds {x.shape[0]} images but {lab_path} holds {y.shape[0]} "
                f"labels; the files do not belong together"
            )
        if y.size and int(y.max()) >= 10:
            raise DataError(f"{lab_path} holds label {int(y.max())}; Fashion-MNIST has 10 classes")
        images.append(x)
        labels.append(y)
    x = np.concatenate(images)[:, None, :, :]
    y = np.concatenate(labels).astype(np.int64)
    return DatasetArrays(images=np.ascontiguousarray(x), labels=y, num_classes=10, name="fmnist")


register_dataset(DatasetSource(
    name="fmnist", num_classes=10, files=fmnist_files, load=load_fmnist, default_root=DEFAULT_FMNIST_ROOT,
))
