"""What the JPEG-folder datasets (Tiny-ImageNet, Flowers102) share: finding the dataset folder,
decoding many JPEGs into one uint8 array, and fingerprinting folders cheaply.

They ship as thousands of JPEG files. These are decoded once, in a fixed (sorted) order, into
one preallocated uint8 array by a few threads (PIL releases the GIL in its JPEG decoder and
resizer, and file I/O overlaps; each image has its own slot, so the result does not depend on
the thread schedule). The partition cache is built from that array and read afterwards.
"""
from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from htfl_dist.errors import DataError

_JPEG_SUFFIXES = (".jpeg", ".jpg")
_DECODE_CHUNK = 256


@dataclass(frozen=True)
class JpegSet:
    """Where a JPEG-folder dataset lives and what its messages tell the user."""

    name: str
    title: str
    folder: str
    """The dataset folder's usual name (``tiny-imagenet-200``)."""
    marker: str
    """A file that identifies the folder even when renamed (``wnids.txt``)."""
    required: tuple[str, ...]
    """Entries the folder must hold (a name ending in '/' is a directory)."""
    get: str
    """How to obtain the dataset (said when it is not found)."""
    fix: str
    """How to repair it (said when a file is missing or broken)."""


def flat(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())


def jpeg_folder(spec: JpegSet, root: str | None) -> str:
    """The dataset folder (``.../tiny-imagenet-200`` or ``.../flowers-102``) under ``root``.

    ``root`` is the directory holding that folder or the folder itself (recognised by its
    name or by its marker file, wnids.txt / imagelabels.mat, so a renamed copy works too).
    Its metadata files and image directories must all be there (one-line DataError naming them).
    """
    if not root:
        raise DataError(
            f"data.dataset={spec.name} needs data.root=DIR, a directory holding {spec.folder}/ "
            f"({spec.get}; nothing is downloaded)"
        )
    root = os.path.normpath(root)
    if os.path.basename(root) == spec.folder or os.path.isfile(os.path.join(root, spec.marker)):
        folder = root
    else:
        folder = os.path.join(root, spec.folder)
    if not os.path.isdir(folder):
        raise DataError(
            f"{spec.title} not found at {root}: expected {folder}/; set data.root=DIR to the "
            f"directory holding {spec.folder}/ or {spec.get}"
        )
    _require(folder, spec)
    return folder


def _require(folder: str, spec: JpegSet) -> None:
    """DataError naming every missing required entry (a name ending in '/' is a directory)."""
    missing = [
        e for e in spec.required
        if not (os.path.isdir if e.endswith("/") else os.path.isfile)(os.path.join(folder, e))
    ]
    if missing:
        raise DataError(
            f"{spec.title} directory {folder} lacks {', '.join(missing)}; {spec.fix}"
        )


def jpeg_names(directory: str) -> list[str]:
    """JPEG file names in ``directory``, sorted (the order ImageFolder uses)."""
    with os.scandir(directory) as it:
        return sorted(e.name for e in it if e.name.lower().endswith(_JPEG_SUFFIXES))


def _bilinear():
    from PIL import Image

    return getattr(Image, "Resampling", Image).BILINEAR


def _read_rgb(path: str, size: int, resize: bool, fix: str) -> np.ndarray:
    """One image as uint8 H x W x 3 (RGB; grayscale/CMYK converted), ``size`` x ``size``."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")  # decodes the whole file: truncation is detected here
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # PIL.UnidentifiedImageError and "image file is truncated" are OSErrors.
        raise DataError(
            f"cannot decode image {path} ({type(exc).__name__}: {flat(exc)}); the file is "
            f"missing, corrupt or truncated: replace it or {fix}"
        ) from None
    if rgb.size != (size, size):
        if not resize:
            raise DataError(
                f"image {path} is {rgb.size[0]}x{rgb.size[1]} pixels, expected {size}x{size}; "
                f"replace it or {fix}"
            )
        rgb = rgb.resize((size, size), _bilinear())
    return np.asarray(rgb, dtype=np.uint8)


def _decode_workers(items: int) -> int:
    """Decoding threads: one per usable CPU, at most 8 (several ranks may decode at once)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus, items))


def decode_images(paths: list[str], size: int, resize: bool, fix: str) -> np.ndarray:
    """Decode ``paths`` in order into one uint8 N x 3 x ``size`` x ``size`` array.

    A few threads share the work (I/O and PIL's decoder overlap; on a network file system the
    latency of opening files dominates). The first failure stops the others and is raised as a
    DataError naming the file.
    """
    n = len(paths)
    out = np.empty((n, 3, size, size), dtype=np.uint8)
    stop = threading.Event()

    def work(bounds: tuple[int, int]) -> None:
        for i in range(*bounds):
            if stop.is_set():
                return
            try:
                out[i] = _read_rgb(paths[i], size, resize, fix).transpose(2, 0, 1)
            except BaseException:
                stop.set()
                raise

    workers = _decode_workers(n)
    size_ = max(1, min(_DECODE_CHUNK, -(-n // (4 * workers))))  # >= 4 chunks per thread
    chunks = [(s, min(s + size_, n)) for s in range(0, n, size_)]
    if workers == 1:
        for bounds in chunks:
            work(bounds)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="htfl-decode") as pool:
            for _ in pool.map(work, chunks):
                pass
    return out


def dir_entry(folder: str, rel: str) -> list:
    """Fingerprint of an image directory: [rel/, number of entries, mtime in ns]."""
    path = os.path.join(folder, rel)
    return [rel.rstrip("/") + "/", len(os.listdir(path)), int(os.stat(path).st_mtime_ns)]


def file_entry(folder: str, rel: str) -> list:
    """Fingerprint of a metadata file: [rel, size, mtime in ns]."""
    stat = os.stat(os.path.join(folder, rel))
    return [rel, int(stat.st_size), int(stat.st_mtime_ns)]


def digest(entries: list[list]) -> str:
    """A short digest folding many fingerprint entries into one."""
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
