"""Flowers102 from torchvision's ``flowers-102`` folder (``jpg/``, ``imagelabels.mat``,
``setid.mat``): all 8189 images, torchvision's train + val + test in that order, as PFLlib reads
them."""
from __future__ import annotations

import os

import numpy as np

from htfl_dist.errors import DataError

from .jpeg import JpegSet, decode_images, dir_entry, file_entry, flat, jpeg_folder
from .registry import DatasetArrays, DatasetSource, register_dataset

NUM_CLASSES = 102

IMAGE_SIZE = 64
"""Side of the square uint8 images. Flowers102 images vary in size and are resized to 64 x 64
with PIL's bilinear filter after conversion to RGB: what PFLlib/HtFLlib's
``generate_Flowers102.py`` gets from ``transforms.Resize((64, 64))`` (torchvision's default
bilinear on PIL images), aspect ratio not kept, no crop."""

FLOWERS = JpegSet(
    name="flowers102",
    title="Flowers102",
    folder="flowers-102",
    marker="imagelabels.mat",
    required=("jpg/", "imagelabels.mat", "setid.mat"),
    get="fetch it once with torchvision.datasets.Flowers102(DIR, download=True)",
    fix="re-fetch it with torchvision.datasets.Flowers102(DIR, download=True)",
)

_FLOWERS_SPLITS = ("trnid", "valid", "tstid")  # torchvision's train / val / test keys


def _read_mat(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    fix = FLOWERS.fix
    try:
        from scipy.io import loadmat
        from scipy.io.matlab import MatReadError
    except ImportError:
        raise DataError(
            f"reading Flowers102's {os.path.basename(path)} needs scipy: pip install scipy"
        ) from None
    try:
        mat = loadmat(path)
    except (OSError, ValueError, TypeError, EOFError, NotImplementedError, MatReadError) as exc:
        raise DataError(
            f"cannot read {path} ({type(exc).__name__}: {flat(exc)}); the file is corrupt: {fix}"
        ) from None
    missing = [k for k in keys if k not in mat]
    if missing:
        raise DataError(f"{path} has no {', '.join(repr(k) for k in missing)} array; {fix}")
    out = {}
    for key in keys:
        try:
            out[key] = np.asarray(mat[key]).ravel().astype(np.int64)
        except (TypeError, ValueError):
            raise DataError(f"{path}: {key!r} is not an array of integers; {fix}") from None
    return out


def flowers102_files(root: str | None) -> list[str]:
    """The metadata files and the image directory Flowers102 is read from."""
    folder = jpeg_folder(FLOWERS, root)
    return [os.path.join(folder, e.rstrip("/")) for e in FLOWERS.required]


def flowers102_fingerprint(root: str | None) -> list[list]:
    """The two .mat files and the jpg/ directory (its entry count and mtime)."""
    folder = jpeg_folder(FLOWERS, root)
    return [
        ["preprocess", "RGB", IMAGE_SIZE, "PIL-bilinear"],
        file_entry(folder, "imagelabels.mat"),
        file_entry(folder, "setid.mat"),
        dir_entry(folder, "jpg"),
    ]


def load_flowers102(root: str | None) -> DatasetArrays:
    """All 8189 images (torchvision's train + val + test, in that order, as PFLlib reads them)."""
    folder = jpeg_folder(FLOWERS, root)
    fix = FLOWERS.fix
    labels_path = os.path.join(folder, "imagelabels.mat")
    setid_path = os.path.join(folder, "setid.mat")
    labels_1 = _read_mat(labels_path, ("labels",))["labels"]
    num_classes = NUM_CLASSES
    if labels_1.size and (labels_1.min() < 1 or labels_1.max() > num_classes):
        bad = labels_1[(labels_1 < 1) | (labels_1 > num_classes)][0]
        raise DataError(
            f"{labels_path} holds label {int(bad)}; Flowers102 labels are 1..{num_classes}: {fix}"
        )
    jpg_dir = os.path.join(folder, "jpg")
    with os.scandir(jpg_dir) as it:
        n_jpg = sum(1 for e in it if e.name.startswith("image_") and e.name.endswith(".jpg"))
    if n_jpg != labels_1.size:
        raise DataError(
            f"Flowers102 {jpg_dir} holds {n_jpg} images but {labels_path} labels "
            f"{labels_1.size}; {fix}"
        )
    splits = _read_mat(setid_path, _FLOWERS_SPLITS)
    ids = np.concatenate([splits[k] for k in _FLOWERS_SPLITS])
    if ids.size != labels_1.size or not np.array_equal(np.sort(ids), np.arange(1, ids.size + 1)):
        raise DataError(
            f"{setid_path} lists {ids.size} image ids ({np.unique(ids).size} distinct) but "
            f"{labels_path} labels images 1..{labels_1.size}; the files do not belong together: "
            f"{fix}"
        )
    paths = [os.path.join(jpg_dir, f"image_{int(i):05d}.jpg") for i in ids]
    images = decode_images(paths, IMAGE_SIZE, resize=True, fix=fix)
    return DatasetArrays(images=images, labels=labels_1[ids - 1] - 1, num_classes=num_classes,
                         name="flowers102")


register_dataset(DatasetSource(
    name="flowers102", num_classes=NUM_CLASSES, files=flowers102_files, load=load_flowers102,
    fingerprint=flowers102_fingerprint,
))
