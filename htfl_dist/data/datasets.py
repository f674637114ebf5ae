"""Dataset sources: whole datasets as uint8 image arrays, read from local files only.

Nothing here downloads. Fashion-MNIST comes from IDX files (the Debian package
``dataset-fashion-mnist`` installs them under ``/usr/share/datasets/fashion-mnist``);
CIFAR-10/100 come from a torchvision-layout root. Train and test parts are concatenated,
as PFLlib does: the federated split is made from all samples.
"""
from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass

import numpy as np

from htfl_dist.config import DEFAULT_FMNIST_ROOT
from htfl_dist.errors import ConfigError, DataError

NUM_CLASSES = {"fmnist": 10, "cifar10": 10, "cifar100": 100}

FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

_CIFAR = {
    "cifar10": {
        "title": "CIFAR-10",
        "folder": "cifar-10-batches-py",
        "files": ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                  "data_batch_5", "test_batch", "batches.meta"),
        "tv": "CIFAR10",
    },
    "cifar100": {
        "title": "CIFAR-100",
        "folder": "cifar-100-python",
        "files": ("train", "test", "meta"),
        "tv": "CIFAR100",
    },
}

_IDX_UBYTE = 0x08


@dataclass
class DatasetArrays:
    """A whole dataset in memory: ``images`` uint8 N x C x H x W, ``labels`` int64 N."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    name: str


# --------------------------------------------------------------------------- Fashion-MNIST


def _find_idx_file(root: str, stem: str) -> str | None:
    """The plain file if present, else the ``.gz`` one, else None."""
    for candidate in (stem, stem + ".gz"):
        path = os.path.join(root, candidate)
        if os.path.isfile(path):
            return path
    return None


def fmnist_files(root: str) -> list[str]:
    """Paths of the four IDX files under ``root``; DataError naming what is missing."""
    if not os.path.isdir(root):
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
    expected = int(np.prod(dims, dtype=np.int64)) if dims else 0
    body = len(raw) - header
    if body != expected:
        raise DataError(
            f"{path} holds {body} data bytes but its IDX header {dims} needs {expected}; "
            f"the file is truncated or corrupt: replace it"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _load_fmnist(root: str) -> DatasetArrays:
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


# --------------------------------------------------------------------------- CIFAR


def cifar_root(name: str, root: str | None) -> str:
    """The torchvision root (the directory that holds ``cifar-10-batches-py``)."""
    spec = _CIFAR[name]
    if not root:
        raise DataError(
            f"data.dataset={name} needs data.root=DIR, a torchvision root holding "
            f"{spec['folder']}/ (fetch it once with torchvision.datasets.{spec['tv']}(DIR, "
            f"download=True))"
        )
    # Accept the dataset folder itself as well as its parent.
    if os.path.basename(os.path.normpath(root)) == spec["folder"]:
        root = os.path.dirname(os.path.normpath(root))
    folder = os.path.join(root, spec["folder"])
    if not os.path.isdir(folder):
        raise DataError(
            f"{spec['title']} not found at {root}: expected {folder}/ (torchvision layout); set "
            f"data.root=DIR or fetch it once with torchvision.datasets.{spec['tv']}(DIR, "
            f"download=True)"
        )
    missing = [f for f in spec["files"] if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(
            f"{spec['title']} directory {folder} lacks {', '.join(missing)}; re-fetch it with "
            f"torchvision.datasets.{spec['tv']}(DIR, download=True)"
        )
    return root


def cifar_files(name: str, root: str | None) -> list[str]:
    base = cifar_root(name, root)
    spec = _CIFAR[name]
    return [os.path.join(base, spec["folder"], f) for f in spec["files"]]


def _load_cifar(name: str, root: str | None) -> DatasetArrays:
    base = cifar_root(name, root)
    spec = _CIFAR[name]
    import torchvision

    cls = getattr(torchvision.datasets, spec["tv"])
    images, labels = [], []
    for train in (True, False):
        try:
            part = cls(base, train=train, download=False)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise DataError(
                f"{spec['title']} at {base} failed torchvision's integrity check ({exc}); "
                f"re-fetch it with torchvision.datasets.{spec['tv']}(DIR, download=True)"
            ) from None
        images.append(np.asarray(part.data, dtype=np.uint8).transpose(0, 3, 1, 2))
        labels.append(np.asarray(part.targets, dtype=np.int64))
    return DatasetArrays(
        images=np.ascontiguousarray(np.concatenate(images)),
        labels=np.concatenate(labels),
        num_classes=NUM_CLASSES[name],
        name=name,
    )


# --------------------------------------------------------------------------- entry points


def _check_name(name: str) -> None:
    if name not in NUM_CLASSES:
        raise ConfigError(
            f"config key 'data.dataset' is {name!r}; allowed: {', '.join(NUM_CLASSES)}"
        )


def dataset_files(name: str, root: str | None) -> list[str]:
    """The files ``load_dataset`` would read (raises the same DataError when missing)."""
    _check_name(name)
    if name == "fmnist":
        return fmnist_files(root or DEFAULT_FMNIST_ROOT)
    return cifar_files(name, root)


def dataset_fingerprint(name: str, root: str | None) -> list[list]:
    """A cheap fingerprint of the source files: (file name, size, mtime in ns) each."""
    out = []
    for path in dataset_files(name, root):
        stat = os.stat(path)
        out.append([os.path.basename(path), int(stat.st_size), int(stat.st_mtime_ns)])
    return out


def load_dataset(name: str, root: str | None) -> DatasetArrays:
    """Load train + test of ``name`` from ``root`` (fmnist default: the OS package dir)."""
    _check_name(name)
    if name == "fmnist":
        return _load_fmnist(root or DEFAULT_FMNIST_ROOT)
    return _load_cifar(name, root)
