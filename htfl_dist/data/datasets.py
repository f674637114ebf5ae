"""Dataset sources: whole datasets as uint8 image arrays, read from local files only.

Nothing here downloads. Fashion-MNIST comes from IDX files (the Debian package
``dataset-fashion-mnist`` installs them under ``/usr/share/datasets/fashion-mnist``);
CIFAR-10/100 come from a torchvision-layout root; Tiny-ImageNet from the extracted
``tiny-imagenet-200.zip`` and Flowers102 from torchvision's ``flowers-102`` folder (JPEGs,
decoded once into uint8 arrays; afterwards the HDF5 partition cache is read). Train and test
parts are concatenated, as PFLlib does: the federated split is made from all samples.
"""
from __future__ import annotations

import gzip
import hashlib
import math
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from htfl_dist.config import DEFAULT_FMNIST_ROOT
from htfl_dist.errors import ConfigError, DataError

NUM_CLASSES = {"fmnist": 10, "cifar10": 10, "cifar100": 100, "tinyimagenet": 200, "flowers102": 102}

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
    expected = math.prod(dims) if dims else 0  # Python ints: four 32-bit dims overflow int64
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


# --------------------------------------------------------------------------- JPEG folders
#
# Tiny-ImageNet and Flowers102 ship as thousands of JPEG files. They are decoded once, in a
# fixed (sorted) order, into one preallocated uint8 array by a few threads (PIL releases the
# GIL in its JPEG decoder and resizer, and file I/O overlaps; each image has its own slot, so
# the result does not depend on the thread schedule). The partition cache is built from that array and read afterwards.

IMAGE_SIZE = {"tinyimagenet": 64, "flowers102": 64}
"""Side of the square uint8 images. Tiny-ImageNet images are 64 x 64 already (any other size is
an error). Flowers102 images vary in size and are resized to 64 x 64 with PIL's bilinear filter
after conversion to RGB: what PFLlib/HtFLlib's ``generate_Flowers102.py`` gets from
``transforms.Resize((64, 64))`` (torchvision's default bilinear on PIL images), aspect ratio
not kept, no crop."""

_JPEG_SETS = {
    "tinyimagenet": {
        "title": "Tiny-ImageNet",
        "folder": "tiny-imagenet-200",
        "marker": "wnids.txt",
        "get": "unzip http://cs231n.stanford.edu/tiny-imagenet-200.zip in DIR",
        "fix": "re-extract tiny-imagenet-200.zip",
    },
    "flowers102": {
        "title": "Flowers102",
        "folder": "flowers-102",
        "marker": "imagelabels.mat",
        "get": "fetch it once with torchvision.datasets.Flowers102(DIR, download=True)",
        "fix": "re-fetch it with torchvision.datasets.Flowers102(DIR, download=True)",
    },
}

_JPEG_SUFFIXES = (".jpeg", ".jpg")
_DECODE_CHUNK = 256


def _flat(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())


def jpeg_folder(name: str, root: str | None) -> str:
    """The dataset folder (``.../tiny-imagenet-200`` or ``.../flowers-102``) under ``root``.

    ``root`` is the directory holding that folder or the folder itself (recognised by its
    name or by its marker file, wnids.txt / imagelabels.mat, so a renamed copy works too).
    Its metadata files and image directories must all be there (one-line DataError naming them).
    """
    spec = _JPEG_SETS[name]
    if not root:
        raise DataError(
            f"data.dataset={name} needs data.root=DIR, a directory holding {spec['folder']}/ "
            f"({spec['get']}; nothing is downloaded)"
        )
    root = os.path.normpath(root)
    if os.path.basename(root) == spec["folder"] or os.path.isfile(os.path.join(root, spec["marker"])):
        folder = root
    else:
        folder = os.path.join(root, spec["folder"])
    if not os.path.isdir(folder):
        raise DataError(
            f"{spec['title']} not found at {root}: expected {folder}/; set data.root=DIR to the "
            f"directory holding {spec['folder']}/ or {spec['get']}"
        )
    _require(folder, name, _META[name])
    return folder


def _require(folder: str, name: str, entries: list[str]) -> None:
    """DataError naming every missing entry (a name ending in '/' is a directory)."""
    missing = [
        e for e in entries
        if not (os.path.isdir if e.endswith("/") else os.path.isfile)(os.path.join(folder, e))
    ]
    if missing:
        spec = _JPEG_SETS[name]
        raise DataError(
            f"{spec['title']} directory {folder} lacks {', '.join(missing)}; {spec['fix']}"
        )


def _jpeg_names(directory: str) -> list[str]:
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
            f"cannot decode image {path} ({type(exc).__name__}: {_flat(exc)}); the file is "
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


def _dir_entry(folder: str, rel: str) -> list:
    """Fingerprint of an image directory: [rel/, number of entries, mtime in ns]."""
    path = os.path.join(folder, rel)
    return [rel.rstrip("/") + "/", len(os.listdir(path)), int(os.stat(path).st_mtime_ns)]


def _file_entry(folder: str, rel: str) -> list:
    stat = os.stat(os.path.join(folder, rel))
    return [rel, int(stat.st_size), int(stat.st_mtime_ns)]


def _digest(entries: list[list]) -> str:
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


# ---- Tiny-ImageNet

_TINY_META = ["wnids.txt", "train/", "val/images/", "val/val_annotations.txt"]


def _tiny_wnids(folder: str) -> list[str]:
    """Class ids, sorted: label k = the k-th wnid in sorted order.

    Sorted rather than wnids.txt's line order because that is what PFLlib/HtFLlib's generator
    gets (torchvision ImageFolder on train/ sorts the class folders), so class ids, and with
    them the pathological split's class-to-client assignment, match the reference code.
    """
    path = os.path.join(folder, "wnids.txt")
    with open(path, encoding="utf-8") as handle:
        wnids = [line.strip() for line in handle if line.strip()]
    if not wnids:
        raise DataError(f"{path} lists no classes; re-extract tiny-imagenet-200.zip")
    if len(set(wnids)) != len(wnids):
        dup = sorted({w for w in wnids if wnids.count(w) > 1})[0]
        raise DataError(f"{path} lists class {dup} twice; re-extract tiny-imagenet-200.zip")
    return sorted(wnids)


def _tiny_val(folder: str, index: dict[str, int]) -> tuple[list[str], list[int]]:
    """val/images files (sorted by name) and their labels from val/val_annotations.txt."""
    ann_path = os.path.join(folder, "val", "val_annotations.txt")
    label_of: dict[str, int] = {}
    with open(ann_path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) < 2:
                raise DataError(
                    f"{ann_path} line {number} is not 'FILE<TAB>WNID<TAB>box'; "
                    f"re-extract tiny-imagenet-200.zip"
                )
            file_name, wnid = fields[0].strip(), fields[1].strip()
            if wnid not in index:
                raise DataError(
                    f"{ann_path} line {number} labels {file_name} with class {wnid}, which "
                    f"wnids.txt does not list; re-extract tiny-imagenet-200.zip"
                )
            if file_name in label_of:
                raise DataError(
                    f"{ann_path} labels {file_name} twice (line {number}); "
                    f"re-extract tiny-imagenet-200.zip"
                )
            label_of[file_name] = index[wnid]
    images_dir = os.path.join(folder, "val", "images")
    names = _jpeg_names(images_dir)
    if len(names) != len(label_of):
        raise DataError(
            f"Tiny-ImageNet {images_dir} holds {len(names)} images but {ann_path} labels "
            f"{len(label_of)}; re-extract tiny-imagenet-200.zip"
        )
    unlabelled = [n for n in names if n not in label_of]
    if unlabelled:
        raise DataError(
            f"Tiny-ImageNet {os.path.join(images_dir, unlabelled[0])} has no label in {ann_path}; "
            f"re-extract tiny-imagenet-200.zip"
        )
    return [os.path.join(images_dir, n) for n in names], [label_of[n] for n in names]


def _tiny_train(folder: str, wnids: list[str]) -> tuple[list[str], list[int]]:
    """train/<wnid>/images/*.JPEG, classes in sorted wnid order, files sorted by name."""
    paths: list[str] = []
    labels: list[int] = []
    for label, wnid in enumerate(wnids):
        directory = os.path.join(folder, "train", wnid, "images")
        if not os.path.isdir(directory):
            raise DataError(
                f"Tiny-ImageNet directory {folder} lacks train/{wnid}/images/ (class {wnid} is "
                f"listed in wnids.txt); re-extract tiny-imagenet-200.zip"
            )
        names = _jpeg_names(directory)
        if not names:
            raise DataError(
                f"Tiny-ImageNet class folder {directory} holds no .JPEG images; "
                f"re-extract tiny-imagenet-200.zip"
            )
        paths.extend(os.path.join(directory, n) for n in names)
        labels.extend([label] * len(names))
    return paths, labels


def tinyimagenet_files(root: str | None) -> list[str]:
    """The metadata files and image directories Tiny-ImageNet is read from."""
    folder = jpeg_folder("tinyimagenet", root)
    wnids = _tiny_wnids(folder)
    dirs = [os.path.join(folder, "train", w, "images") for w in wnids]
    return [os.path.join(folder, "wnids.txt"), os.path.join(folder, "val", "val_annotations.txt"),
            os.path.join(folder, "val", "images"), *dirs]


def _tinyimagenet_fingerprint(root: str | None) -> list[list]:
    folder = jpeg_folder("tinyimagenet", root)
    wnids = _tiny_wnids(folder)
    class_dirs = []
    for wnid in wnids:
        rel = f"train/{wnid}/images"
        if not os.path.isdir(os.path.join(folder, rel)):
            _tiny_train(folder, [wnid])  # raises the DataError naming the folder
        class_dirs.append(_dir_entry(folder, rel))
    return [
        ["preprocess", "RGB", IMAGE_SIZE["tinyimagenet"], "no-resize"],
        _file_entry(folder, "wnids.txt"),
        _file_entry(folder, "val/val_annotations.txt"),
        _dir_entry(folder, "val/images"),
        ["train/*/images/", sum(e[1] for e in class_dirs), _digest(class_dirs)],
    ]


def _load_tinyimagenet(root: str | None) -> DatasetArrays:
    """train (100,000) + val (10,000) images; the official test split has no labels."""
    folder = jpeg_folder("tinyimagenet", root)
    wnids = _tiny_wnids(folder)
    index = {w: i for i, w in enumerate(wnids)}
    train_paths, train_labels = _tiny_train(folder, wnids)
    val_paths, val_labels = _tiny_val(folder, index)
    images = decode_images(train_paths + val_paths, IMAGE_SIZE["tinyimagenet"], resize=False,
                           fix=_JPEG_SETS["tinyimagenet"]["fix"])
    labels = np.asarray(train_labels + val_labels, dtype=np.int64)
    return DatasetArrays(images=images, labels=labels, num_classes=len(wnids), name="tinyimagenet")


# ---- Flowers102

_FLOWERS_META = ["jpg/", "imagelabels.mat", "setid.mat"]
_FLOWERS_SPLITS = ("trnid", "valid", "tstid")  # torchvision's train / val / test keys
_META = {"tinyimagenet": _TINY_META, "flowers102": _FLOWERS_META}  # what jpeg_folder requires


def _read_mat(path: str, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    fix = _JPEG_SETS["flowers102"]["fix"]
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
            f"cannot read {path} ({type(exc).__name__}: {_flat(exc)}); the file is corrupt: {fix}"
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
    folder = jpeg_folder("flowers102", root)
    return [os.path.join(folder, e.rstrip("/")) for e in _FLOWERS_META]


def _flowers102_fingerprint(root: str | None) -> list[list]:
    folder = jpeg_folder("flowers102", root)
    return [
        ["preprocess", "RGB", IMAGE_SIZE["flowers102"], "PIL-bilinear"],
        _file_entry(folder, "imagelabels.mat"),
        _file_entry(folder, "setid.mat"),
        _dir_entry(folder, "jpg"),
    ]


def _load_flowers102(root: str | None) -> DatasetArrays:
    """All 8189 images (torchvision's train + val + test, in that order, as PFLlib reads them)."""
    folder = jpeg_folder("flowers102", root)
    fix = _JPEG_SETS["flowers102"]["fix"]
    labels_path = os.path.join(folder, "imagelabels.mat")
    setid_path = os.path.join(folder, "setid.mat")
    labels_1 = _read_mat(labels_path, ("labels",))["labels"]
    num_classes = NUM_CLASSES["flowers102"]
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
    images = decode_images(paths, IMAGE_SIZE["flowers102"], resize=True, fix=fix)
    return DatasetArrays(images=images, labels=labels_1[ids - 1] - 1, num_classes=num_classes,
                         name="flowers102")


# --------------------------------------------------------------------------- entry points


def _check_name(name: str) -> None:
    if name not in NUM_CLASSES:
        raise ConfigError(
            f"config key 'data.dataset' is {name!r}; allowed: {', '.join(NUM_CLASSES)}"
        )


def dataset_files(name: str, root: str | None) -> list[str]:
    """The files ``load_dataset`` would read (raises the same DataError when missing).

    For the JPEG datasets: their metadata files and image directories, not every image.
    """
    _check_name(name)
    if name == "fmnist":
        return fmnist_files(root or DEFAULT_FMNIST_ROOT)
    if name == "tinyimagenet":
        return tinyimagenet_files(root)
    if name == "flowers102":
        return flowers102_files(root)
    return cifar_files(name, root)


def dataset_fingerprint(name: str, root: str | None) -> list[list]:
    """A cheap fingerprint of the source, part of the partition cache key.

    FMNIST / CIFAR: (file name, size, mtime in ns) of each source file.

    Tiny-ImageNet (110,000 JPEGs) and Flowers102 (8,189): stat-ing every image would cost
    minutes on a cluster file system, and every rank computes this key at every start. So the
    fingerprint covers the metadata files (wnids.txt, val_annotations.txt, imagelabels.mat,
    setid.mat: name, size, mtime) and each image directory's entry count and mtime (one listing
    per directory, no stat per file; the 200 Tiny-ImageNet class folders are folded into one
    digest), plus the preprocessing (RGB, output size, resize filter). Adding, removing or
    renaming an image changes its directory's mtime and usually its count, so the cache is
    rebuilt; an image overwritten in place under the same name is not noticed: delete the
    partition cache (data.cache_dir) after editing images in place. Paths are relative to the
    dataset folder, so a moved copy of the same data reuses its cache.
    """
    _check_name(name)
    if name == "tinyimagenet":
        return _tinyimagenet_fingerprint(root)
    if name == "flowers102":
        return _flowers102_fingerprint(root)
    out = []
    for path in dataset_files(name, root):
        stat = os.stat(path)
        out.append([os.path.basename(path), int(stat.st_size), int(stat.st_mtime_ns)])
    return out


def load_dataset(name: str, root: str | None) -> DatasetArrays:
    """Load all labelled samples of ``name`` from ``root`` (fmnist default: the OS package dir).

    FMNIST / CIFAR: train + test; Tiny-ImageNet: train + val; Flowers102: train + val + test.
    """
    _check_name(name)
    if name == "fmnist":
        return _load_fmnist(root or DEFAULT_FMNIST_ROOT)
    if name == "tinyimagenet":
        return _load_tinyimagenet(root)
    if name == "flowers102":
        return _load_flowers102(root)
    return _load_cifar(name, root)
