"""CIFAR-10 and CIFAR-100 from a torchvision-layout root (``cifar-10-batches-py/`` or
``cifar-100-python/``, or that folder itself), read with torchvision's own classes, which check
the files' md5 sums. Nothing is downloaded; train and test parts are concatenated."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from htfl_dist.errors import DataError

from .registry import DatasetArrays, DatasetSource, register_dataset


@dataclass(frozen=True)
class CifarSpec:
    name: str
    title: str
    folder: str
    files: tuple[str, ...]
    tv: str
    """The torchvision.datasets class that reads it (and that the messages tell users to fetch it with)."""
    num_classes: int


CIFAR10 = CifarSpec(
    name="cifar10", title="CIFAR-10", folder="cifar-10-batches-py",
    files=("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
           "test_batch", "batches.meta"),
    tv="CIFAR10", num_classes=10,
)
CIFAR100 = CifarSpec(
    name="cifar100", title="CIFAR-100", folder="cifar-100-python", files=("train", "test", "meta"),
    tv="CIFAR100", num_classes=100,
)


def cifar_root(spec: CifarSpec, root: str | None) -> str:
    """The torchvision root (the directory that holds ``cifar-10-batches-py``)."""
    if not root:
        raise DataError(
            f"data.dataset={spec.name} needs data.root=DIR, a torchvision root holding "
            f"{spec.folder}/ (fetch it once with torchvision.datasets.{spec.tv}(DIR, "
            f"download=True))"
        )
    # Accept the dataset folder itself as well as its parent.
    if os.path.basename(os.path.normpath(root)) == spec.folder:
        root = os.path.dirname(os.path.normpath(root))
    folder = os.path.join(root, spec.folder)
    if not os.path.isdir(folder):
        raise DataError(
            f"{spec.title} not found at {root}: expected {folder}/ (torchvision layout); set "
            f"data.root=DIR or fetch it once with torchvision.datasets.{spec.tv}(DIR, "
            f"download=True)"
        )
    missing = [f for f in spec.files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(
            f"{spec.title} directory {folder} lacks {', '.join(missing)}; re-fetch it with "
            f"torchvision.datasets.{spec.tv}(DIR, download=True)"
        )
    return root


def cifar_files(spec: CifarSpec, root: str | None) -> list[str]:
    base = cifar_root(spec, root)
    return [os.path.join(base, spec.folder, f) for f in spec.files]


def load_cifar(spec: CifarSpec, root: str | None) -> DatasetArrays:
    base = cifar_root(spec, root)
    import torchvision

    cls = getattr(torchvision.datasets, spec.tv)  # a constant of this module, never a config string
    images, labels = [], []
    for train in (True, False):
        try:
            part = cls(base, train=train, download=False)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise DataError(
                f"{spec.title} at {base} failed torchvision's integrity check ({exc}); "
                f"re-fetch it with torchvision.datasets.{spec.tv}(DIR, download=True)"
            ) from None
        images.append(np.asarray(part.data, dtype=np.uint8).transpose(0, 3, 1, 2))
        labels.append(np.asarray(part.targets, dtype=np.int64))
    return DatasetArrays(
        images=np.ascontiguousarray(np.concatenate(images)),
        labels=np.concatenate(labels),
        num_classes=spec.num_classes,
        name=spec.name,
    )


for _spec in (CIFAR10, CIFAR100):
    register_dataset(DatasetSource(
        name=_spec.name, num_classes=_spec.num_classes,
        files=functools.partial(cifar_files, _spec), load=functools.partial(load_cifar, _spec),
    ))
