"""Digit-5 (MNIST, MNIST-M, SVHN, SynthDigits, USPS: ten digits, five domains) from the raw
``.mat`` files PFLlib's ``dataset/generate_Digit5.py`` reads (the unzipped ``Digit5.zip``, its
``rawdata/`` folder)::

    mnist_data.mat          train_32, test_32 (N x 32 x 32 grey), label_train, label_test (one-hot N x 10)
    mnistm_with_label.mat   train, test (N x 32 x 32 x 3), label_train, label_test (one-hot)
    svhn_train_32x32.mat    X (32 x 32 x 3 x N), y (N x 1, digit 0 written as 10)
    svhn_test_32x32.mat
    synth_train_32x32.mat   X (32 x 32 x 3 x N), y (N x 1, 10 read as 0 as for SVHN)
    synth_test_32x32.mat
    usps_28x28.mat          dataset: 2 x 2 cells, [train images N x 1 x 28 x 28 in 0..1, labels;
                                                   test images, labels]

Every domain becomes uint8 3 x 32 x 32 (grey repeated over three channels, USPS resized from 28
with PIL's bilinear filter: what ``transforms.Resize(32)`` gives the generator), train then test
samples. Unlike the generator, every sample is kept: it keeps a random 25,000 train and the
first 9,000 test samples of each domain and repeats USPS's 7,291 train samples four times.
"""
from __future__ import annotations

import os

import numpy as np

from htfl_dist.errors import DataError

from .domains import DomainSuite, as_uint8, missing_domain, register_suite, suite_root, to_rgb_square
from .jpeg import file_entry, flat

IMAGE_SIZE = 32

FILES = {
    "mnistm": ("mnistm_with_label.mat",),
    "mnist": ("mnist_data.mat",),
    "syn": ("synth_train_32x32.mat", "synth_test_32x32.mat"),
    "usps": ("usps_28x28.mat",),
    "svhn": ("svhn_train_32x32.mat", "svhn_test_32x32.mat"),
}
"""Each domain's files, in PFLlib's domain order (``['mnistm', 'mnist', 'syn', 'usps', 'svhn']``)."""

GET = ("unzip PFLlib's Digit5.zip (the link in its dataset/generate_Digit5.py) into DIR, so that DIR "
       "holds the seven .mat files")


def digit5_folder(root: str | None) -> str:
    return suite_root(root, "digit5", "Digit-5's .mat files", GET)


def digit5_files(folder: str, domain: str) -> list[str]:
    paths = [os.path.join(folder, name) for name in FILES[domain]]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise missing_domain(SUITE, folder, domain, missing)
    return paths


def digit5_fingerprint(folder: str, domain: str) -> list[list]:
    return [["preprocess", domain, "RGB", IMAGE_SIZE, "PIL-bilinear"],
            *(file_entry(folder, name) for name in FILES[domain])]


def _read_mat(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        from scipy.io import loadmat
        from scipy.io.matlab import MatReadError
    except ImportError:
        raise DataError(f"reading Digit-5's {os.path.basename(path)} needs scipy: pip install scipy") from None
    try:
        mat = loadmat(path)
    except (OSError, ValueError, TypeError, EOFError, NotImplementedError, MatReadError) as exc:
        raise DataError(f"cannot read {path} ({type(exc).__name__}: {flat(exc)}); the file is corrupt: {GET}") from None
    missing = [k for k in keys if k not in mat]
    if missing:
        raise DataError(f"{path} has no {', '.join(repr(k) for k in missing)} array; it is not Digit-5's file: {GET}")
    return {key: mat[key] for key in keys}


def _labels(values: np.ndarray, ten_is_zero: bool) -> np.ndarray:
    """Class ids from one-hot rows (argmax, as the generator) or a column of ids."""
    values = np.asarray(values)
    labels = values.argmax(axis=1) if values.ndim == 2 and values.shape[1] > 1 else values.reshape(-1)
    labels = labels.astype(np.int64)
    if ten_is_zero:
        labels[labels == 10] = 0
    return labels


def _images(path: str, values: np.ndarray, count: int, layout: str) -> np.ndarray:
    """uint8 N x 3 x 32 x 32 from one array stored in ``layout``."""
    values = np.asarray(values)
    try:
        if layout == "grey":  # N x 32 x 32 (or N x 1024, N x 32 x 32 x 1)
            nchw = values.reshape(count, 1, 32, 32)
        elif layout == "nhwc":
            nchw = values.reshape(count, 32, 32, 3).transpose(0, 3, 1, 2)
        elif layout == "hwcn":  # the generator's transpose(3, 2, 0, 1)
            if values.shape[3] != count:
                raise ValueError("count")
            nchw = values.transpose(3, 2, 0, 1)
        else:  # usps: N x 1 x 28 x 28 in 0..1
            nchw = np.asarray(values, dtype=np.float64).reshape(count, 1, 28, 28) * 255
    except (ValueError, IndexError):
        raise DataError(f"{path} holds pictures of shape {values.shape} for {count} labels; it is not Digit-5's "
                        f"file: {GET}") from None
    return to_rgb_square(as_uint8(nchw), IMAGE_SIZE)


def load_digit5_domain(folder: str, domain: str) -> tuple[np.ndarray, np.ndarray]:
    paths = digit5_files(folder, domain)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    if domain in ("mnist", "mnistm"):
        x_keys = ("train_32", "test_32") if domain == "mnist" else ("train", "test")
        mat = _read_mat(paths[0], (*x_keys, "label_train", "label_test"))
        for x_key, y_key in zip(x_keys, ("label_train", "label_test"), strict=True):
            labels = _labels(mat[y_key], ten_is_zero=False)
            parts.append((_images(paths[0], mat[x_key], labels.size, "grey" if domain == "mnist" else "nhwc"),
                          labels))
    elif domain in ("svhn", "syn"):
        for path in paths:
            mat = _read_mat(path, ("X", "y"))
            labels = _labels(mat["y"], ten_is_zero=True)
            parts.append((_images(path, mat["X"], labels.size, "hwcn"), labels))
    else:
        cells = _read_mat(paths[0], ("dataset",))["dataset"]
        try:
            pairs = [(cells[row][0], cells[row][1]) for row in (0, 1)]
        except (IndexError, TypeError):
            raise DataError(f"{paths[0]}: 'dataset' is not USPS's 2 x 2 cells; {GET}") from None
        for x, y in pairs:
            labels = _labels(y, ten_is_zero=True)
            parts.append((_images(paths[0], x, labels.size, "usps"), labels))
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


SUITE = DomainSuite(
    name="digit5",
    domains=tuple(FILES),
    num_classes=10,
    image_size=IMAGE_SIZE,
    files=digit5_files,
    load=load_digit5_domain,
    folder=digit5_folder,
    fingerprint=digit5_fingerprint,
    get=GET,
)
register_suite(SUITE)
