"""Data layer: sources, partitioners, splits, the HDF5 cache and the PFLlib reader.

Uses the real Fashion-MNIST from the OS package (``dataset-fashion-mnist``) with
``data.subsample`` to stay fast; PFLlib directories and broken IDX files are synthesised in
``tmp_path``.
"""
from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import time

import h5py
import numpy as np
import pytest
import torch

from htfl_dist.config import DEFAULT_FMNIST_ROOT, PLUGIN_HINT, DataConfig
from htfl_dist.data import (
    ClientSplit,
    DatasetArrays,
    PartitionInfo,
    load_client_split,
    load_dataset,
    partition_dirichlet,
    partition_pathological,
    prepare_partition,
    read_partition_info,
    split_train_test,
    subsample_indices,
    train_count,
)
from htfl_dist.data.datasets import dataset_files, dataset_fingerprint
from htfl_dist.data.sources import (
    DatasetSource,
    dataset_names,
    dataset_source,
    register_dataset,
    registry,
)
from htfl_dist.data.sources import jpeg as jpeg_module
from htfl_dist.errors import ConfigError, DataError
from htfl_dist.seeding import numpy_rng

HAVE_FMNIST = os.path.isdir(DEFAULT_FMNIST_ROOT)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST, reason="apt-get install dataset-fashion-mnist to run this test"
)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.fixture(scope="module")
def fmnist() -> DatasetArrays:
    if not HAVE_FMNIST:
        pytest.skip("apt-get install dataset-fashion-mnist to run this test")
    return load_dataset("fmnist", None)


def _synthetic_labels(per_class: int, num_classes: int) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(123).permutation(labels).astype(np.int64)


# --------------------------------------------------------------------------- sources


def test_fmnist_loads_train_and_test(fmnist):
    assert fmnist.name == "fmnist" and fmnist.num_classes == 10
    assert fmnist.images.shape == (70000, 1, 28, 28) and fmnist.images.dtype == np.uint8
    assert fmnist.labels.shape == (70000,) and fmnist.labels.dtype == np.int64
    assert np.array_equal(np.bincount(fmnist.labels), np.full(10, 7000))
    assert fmnist.images.max() == 255 and fmnist.images.min() == 0


def _write_idx(path, array: np.ndarray, gz: bool, magic: int | None = None) -> None:
    ndim = array.ndim
    header = (magic if magic is not None else (0x08 << 8) | ndim).to_bytes(4, "big")
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        raw = gzip.compress(raw)
        path = str(path) + ".gz"
    with open(path, "wb") as handle:
        handle.write(raw)


def _fake_fmnist(root, gz: bool, n_train=12, n_test=5):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(os.path.join(root, f"{prefix}-images-idx3-ubyte"),
                   rng.integers(0, 256, (n, 28, 28)), gz)
        _write_idx(os.path.join(root, f"{prefix}-labels-idx1-ubyte"),
                   rng.integers(0, 10, n), gz)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_plain_and_gzip(tmp_path, gz):
    _fake_fmnist(tmp_path, gz)
    data = load_dataset("fmnist", str(tmp_path))
    assert data.images.shape == (17, 1, 28, 28) and data.labels.shape == (17,)


def test_idx_reader_rejects_bad_magic_and_truncation(tmp_path):
    _fake_fmnist(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(good[:-7])  # truncated body
    with pytest.raises(DataError, match="truncated") as exc:
        load_dataset("fmnist", str(tmp_path))
    _one_line(exc)
    images.write_bytes(b"\x00\x00\x08\x01" + good[4:])  # wrong ndim in the magic
    with pytest.raises(DataError, match="magic number"):
        load_dataset("fmnist", str(tmp_path))
    # A truncated gzip stream.
    images.unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(good)[:-20])
    with pytest.raises(DataError, match="corrupt or truncated") as exc:
        load_dataset("fmnist", str(tmp_path))
    _one_line(exc)


def test_idx_header_whose_size_overflows_int64_is_refused(tmp_path):
    """2^31 · 2^31 · 4 = 2^64 wraps to 0 in int64, which an empty body would have matched."""
    _fake_fmnist(tmp_path, gz=False)
    dims = (2**31, 2**31, 4)
    header = b"\x00\x00\x08\x03" + b"".join(d.to_bytes(4, "big") for d in dims)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(header)
    with pytest.raises(DataError, match="needs 18446744073709551616") as exc:
        load_dataset("fmnist", str(tmp_path))
    _one_line(exc)


def test_missing_fmnist_root_message(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", str(missing))
    text = _one_line(exc)
    assert f"Fashion-MNIST not found at {missing}" in text
    assert "apt-get install dataset-fashion-mnist" in text and "data.root=DIR" in text


def test_fmnist_root_without_files_names_them(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(DataError) as exc:
        load_dataset("fmnist", str(tmp_path))
    text = _one_line(exc)
    assert "train-labels-idx1-ubyte" in text and "t10k-images-idx3-ubyte" in text
    assert "train-images-idx3-ubyte(" not in text  # present, so not named as missing


def test_cifar_needs_a_local_root(tmp_path):
    with pytest.raises(DataError, match=r"needs data\.root=DIR") as exc:
        load_dataset("cifar10", None)
    _one_line(exc)
    with pytest.raises(DataError, match="cifar-100-python") as exc:
        load_dataset("cifar100", str(tmp_path))
    _one_line(exc)
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(DataError, match="lacks data_batch_2") as exc:
        load_dataset("cifar10", str(tmp_path))
    _one_line(exc)


# --------------------------------------------------------------------------- Tiny-ImageNet, Flowers102
#
# Tiny fake datasets in the exact on-disk layouts. Image colours encode (split, class, index) so
# labels can be checked against pixels (JPEG is lossy: compared with a tolerance).

TINY_WNIDS = ("n02", "n01", "n03")  # wnids.txt order; labels follow the sorted order
TINY_TRAIN_PER_CLASS = 4
TINY_VAL = (("val_0.JPEG", "n03"), ("val_1.JPEG", "n01"), ("val_10.JPEG", "n02"),
            ("val_2.JPEG", "n02"), ("val_3.JPEG", "n03"), ("val_4.JPEG", "n01"))


def _colour(label: int, index: int, split: int) -> tuple[int, int, int]:
    return (20 + 60 * label, 20 + 30 * index, 40 + 160 * split)


def _jpeg(path, size, colour, mode="RGB") -> None:
    from PIL import Image

    image = Image.new("RGB", size, colour)
    if mode != "RGB":
        image = image.convert(mode)
    image.save(path, "JPEG", quality=95)


def _fake_tiny(base, gray: bool = True):
    """``base/tiny-imagenet-200`` with 3 classes x 4 train images and 6 val images."""
    folder = base / "tiny-imagenet-200"
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "test" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(TINY_WNIDS) + "\n")
    for wnid in TINY_WNIDS:
        label = sorted(TINY_WNIDS).index(wnid)
        images = folder / "train" / wnid / "images"
        images.mkdir(parents=True)
        (folder / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
        for k in range(TINY_TRAIN_PER_CLASS):
            mode = "L" if (gray and wnid == "n01" and k == 1) else "RGB"
            _jpeg(images / f"{wnid}_{k}.JPEG", (64, 64), _colour(label, k, 0), mode)
    lines = []
    for k, (name, wnid) in enumerate(TINY_VAL):
        _jpeg(folder / "val" / "images" / name, (64, 64), _colour(sorted(TINY_WNIDS).index(wnid), k, 1))
        lines.append(f"{name}\t{wnid}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    _jpeg(folder / "test" / "images" / "test_0.JPEG", (64, 64), (0, 0, 0))  # unlabelled: unused
    return folder


def _close(pixel: np.ndarray, colour, tol: int = 4) -> bool:
    return bool(np.all(np.abs(pixel.astype(int) - np.asarray(colour)) <= tol))


def test_tinyimagenet_loads_train_and_val(tmp_path):
    _fake_tiny(tmp_path)
    data = load_dataset("tinyimagenet", str(tmp_path))
    assert data.name == "tinyimagenet" and data.num_classes == 3
    assert data.images.shape == (18, 3, 64, 64) and data.images.dtype == np.uint8
    assert data.labels.dtype == np.int64
    # Train first: classes in sorted wnid order (n01, n02, n03), files sorted; then val sorted by name.
    assert data.labels[:12].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    val_sorted = sorted(TINY_VAL)  # val_0, val_1, val_10, val_2, val_3, val_4
    assert data.labels[12:].tolist() == [sorted(TINY_WNIDS).index(w) for _, w in val_sorted]
    for i in range(12):
        label, k = divmod(i, 4)
        if (label, k) == (0, 1):
            continue  # the grayscale one: checked below
        assert _close(data.images[i, :, 32, 32], _colour(label, k, 0)), i
    for j, (name, wnid) in enumerate(val_sorted):
        k = TINY_VAL.index((name, wnid))
        assert _close(data.images[12 + j, :, 32, 32], _colour(sorted(TINY_WNIDS).index(wnid), k, 1))
    gray = data.images[1]  # n01_1.JPEG was written as mode "L"
    assert np.array_equal(gray[0], gray[1]) and np.array_equal(gray[1], gray[2])


def test_tinyimagenet_train_matches_imagefolder(tmp_path):
    """PFLlib reads train/ with torchvision's ImageFolder: same order, labels and pixels."""
    from torchvision.datasets import ImageFolder

    folder = _fake_tiny(tmp_path)
    data = load_dataset("tinyimagenet", str(tmp_path))
    reference = ImageFolder(str(folder / "train"))
    assert reference.classes == sorted(TINY_WNIDS)
    assert data.labels[:12].tolist() == reference.targets
    for i, (image, _) in enumerate(reference):
        assert np.array_equal(data.images[i], np.asarray(image).transpose(2, 0, 1)), i


def test_tinyimagenet_root_as_folder_and_determinism(tmp_path, monkeypatch):
    folder = _fake_tiny(tmp_path)
    a = load_dataset("tinyimagenet", str(tmp_path))
    b = load_dataset("tinyimagenet", str(folder))
    c = load_dataset("tinyimagenet", str(folder) + "/")
    monkeypatch.setattr(jpeg_module, "_DECODE_CHUNK", 2)  # 9 chunks over several threads
    monkeypatch.setattr(jpeg_module, "_decode_workers", lambda items: min(4, items))
    threaded = load_dataset("tinyimagenet", str(tmp_path))
    for other in (b, c, threaded):
        assert np.array_equal(a.images, other.images) and np.array_equal(a.labels, other.labels)
    bad = folder / "val" / "images" / "val_3.JPEG"
    bad.write_bytes(b"")
    with pytest.raises(DataError, match="cannot decode image") as exc:
        load_dataset("tinyimagenet", str(tmp_path))
    assert str(bad) in _one_line(exc)
    _jpeg(bad, (64, 64), _colour(2, 4, 1))
    renamed = tmp_path / "my-tiny"
    folder.rename(renamed)  # recognised by its wnids.txt
    d = load_dataset("tinyimagenet", str(renamed))
    assert np.array_equal(a.images, d.images) and np.array_equal(a.labels, d.labels)


def _load_error(name: str, root, match: str) -> str:
    """The one-line DataError that loading dataset ``name`` from ``root`` (None: unset) raises."""
    with pytest.raises(DataError, match=match) as exc:
        load_dataset(name, None if root is None else str(root))
    return _one_line(exc)


def _tiny_error(root, match: str) -> str:
    return _load_error("tinyimagenet", root, match)


def test_tinyimagenet_errors(tmp_path):
    text = _tiny_error(None, "needs data.root=DIR")
    assert "tiny-imagenet-200/" in text and "nothing is downloaded" in text
    text = _tiny_error(tmp_path / "nowhere", "Tiny-ImageNet not found")
    assert str(tmp_path / "nowhere" / "tiny-imagenet-200") in text
    folder = _fake_tiny(tmp_path)

    (folder / "wnids.txt").rename(folder / "wnids.bak")
    text = _tiny_error(folder, "lacks wnids.txt")
    assert str(folder) in text and "re-extract tiny-imagenet-200.zip" in text
    (folder / "wnids.bak").rename(folder / "wnids.txt")

    annotations = folder / "val" / "val_annotations.txt"
    good = annotations.read_text()
    annotations.unlink()
    _tiny_error(tmp_path, r"lacks val/val_annotations\.txt")
    annotations.write_text(good.replace("\tn03\t", "\tn99\t", 1))
    text = _tiny_error(tmp_path, "class n99, which wnids.txt does not list")
    assert str(annotations) in text
    annotations.write_text("".join(good.splitlines(keepends=True)[1:]))  # val_0 unlabelled
    text = _tiny_error(tmp_path, "holds 6 images but")
    assert str(folder / "val" / "images") in text and "labels 5" in text
    annotations.write_text(good)

    class_dir = folder / "train" / "n02" / "images"
    moved = tmp_path / "moved"
    class_dir.rename(moved)
    _tiny_error(tmp_path, r"lacks train/n02/images/ \(class n02 is listed in wnids.txt\)")
    class_dir.mkdir()
    text = _tiny_error(tmp_path, "holds no .JPEG images")
    assert str(class_dir) in text
    class_dir.rmdir()
    moved.rename(class_dir)

    bad = class_dir / "n02_2.JPEG"
    bad.write_bytes(bad.read_bytes()[:300])  # truncated JPEG
    text = _tiny_error(tmp_path, "cannot decode image")
    assert str(bad) in text and "corrupt or truncated" in text
    _jpeg(bad, (32, 32), (1, 2, 3))
    text = _tiny_error(tmp_path, "is 32x32 pixels, expected 64x64")
    assert str(bad) in text
    _jpeg(bad, (64, 64), (1, 2, 3))
    assert load_dataset("tinyimagenet", str(tmp_path)).images.shape == (18, 3, 64, 64)


FLOWER_SIZES = ((500, 600), (667, 500), (64, 64), (80, 200), (501, 500), (300, 300), (500, 754),
                (120, 90), (61, 70), (500, 500))
FLOWER_LABELS = (1, 102, 5, 5, 1, 17, 102, 3, 1, 50)  # 1-based, per image id 1..10
FLOWER_SETID = {"trnid": [3, 1, 8], "valid": [10, 2], "tstid": [4, 5, 6, 7, 9]}


def _fake_flowers(base, gray: bool = True):
    from scipy.io import savemat

    folder = base / "flowers-102"
    (folder / "jpg").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k, (w, h) in enumerate(FLOWER_SIZES, 1):
        from PIL import Image

        noise = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        image = Image.fromarray(noise, "RGB")
        if gray and k == 4:
            image = image.convert("L")
        image.save(folder / "jpg" / f"image_{k:05d}.jpg", "JPEG", quality=90)
    savemat(folder / "imagelabels.mat", {"labels": np.asarray([FLOWER_LABELS], dtype=np.uint8)})
    savemat(folder / "setid.mat", {k: np.asarray([v], dtype=np.uint16) for k, v in FLOWER_SETID.items()})
    return folder


def test_flowers102_loads_all_splits_resized_like_pfllib(tmp_path):
    from PIL import Image
    from torchvision import transforms

    folder = _fake_flowers(tmp_path)
    data = load_dataset("flowers102", str(tmp_path))
    assert data.name == "flowers102" and data.num_classes == 102
    assert data.images.shape == (10, 3, 64, 64) and data.images.dtype == np.uint8
    order = FLOWER_SETID["trnid"] + FLOWER_SETID["valid"] + FLOWER_SETID["tstid"]
    assert data.labels.tolist() == [FLOWER_LABELS[i - 1] - 1 for i in order]
    assert data.labels.min() == 0 and data.labels.max() == 101
    # PFLlib: torchvision.datasets.Flowers102 (PIL, RGB) then transforms.Resize((64, 64)).
    resize = transforms.Resize((64, 64))
    for row, image_id in enumerate(order):
        with Image.open(folder / "jpg" / f"image_{image_id:05d}.jpg") as img:
            expected = np.asarray(resize(img.convert("RGB"))).transpose(2, 0, 1)
        assert np.array_equal(data.images[row], expected), image_id
    gray = data.images[order.index(4)]
    assert np.array_equal(gray[0], gray[1]) and np.array_equal(gray[1], gray[2])


def test_flowers102_root_as_folder_and_determinism(tmp_path):
    folder = _fake_flowers(tmp_path)
    a = load_dataset("flowers102", str(tmp_path))
    b = load_dataset("flowers102", str(folder))
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)


def _flowers_error(root, match: str) -> str:
    return _load_error("flowers102", root, match)


def test_flowers102_errors(tmp_path):
    from scipy.io import savemat

    text = _flowers_error(None, "needs data.root=DIR")
    assert "flowers-102/" in text and "torchvision.datasets.Flowers102(DIR, download=True)" in text
    text = _flowers_error(tmp_path, "Flowers102 not found")
    assert str(tmp_path / "flowers-102") in text
    folder = _fake_flowers(tmp_path)

    (folder / "setid.mat").rename(folder / "setid.bak")
    text = _flowers_error(tmp_path, "lacks setid.mat")
    assert str(folder) in text
    (folder / "setid.bak").rename(folder / "setid.mat")

    labels = folder / "imagelabels.mat"
    good = labels.read_bytes()
    labels.write_bytes(b"not a mat file")
    text = _flowers_error(tmp_path, "cannot read")
    assert str(labels) in text
    savemat(labels, {"labels": np.asarray([FLOWER_LABELS[:9]])})
    text = _flowers_error(tmp_path, "holds 10 images but")
    assert str(folder / "jpg") in text and "labels 9" in text
    savemat(labels, {"labels": np.asarray([(0, *FLOWER_LABELS[1:])])})
    _flowers_error(tmp_path, "holds label 0; Flowers102 labels are 1..102")
    savemat(labels, {"other": np.asarray([FLOWER_LABELS])})
    _flowers_error(tmp_path, "has no 'labels' array")
    labels.write_bytes(good)

    savemat(folder / "setid.mat", {"trnid": [[1, 2]], "valid": [[3]], "tstid": [[4, 5, 6, 7, 8, 9, 9]]})
    _flowers_error(tmp_path, r"lists 10 image ids \(9 distinct\)")
    savemat(folder / "setid.mat", {k: np.asarray([v]) for k, v in FLOWER_SETID.items()})

    bad = folder / "jpg" / "image_00007.jpg"
    bad.write_bytes(b"\xff\xd8garbage")
    text = _flowers_error(tmp_path, "cannot decode image")
    assert str(bad) in text
    bad.unlink()
    (folder / "jpg" / "image_00011.jpg").write_bytes(b"")  # right count, wrong names
    text = _flowers_error(tmp_path, "cannot decode image")
    assert str(bad) in text


def test_jpeg_dataset_fingerprint_tracks_directories(tmp_path):
    from htfl_dist.data.datasets import dataset_fingerprint

    folder = _fake_tiny(tmp_path)
    first = dataset_fingerprint("tinyimagenet", str(tmp_path))
    assert dataset_fingerprint("tinyimagenet", str(folder)) == first  # relative paths
    assert len(json.dumps(first)) < 1000  # class folders folded into one digest
    _jpeg(folder / "train" / "n03" / "images" / "n03_9.JPEG", (64, 64), (9, 9, 9))
    second = dataset_fingerprint("tinyimagenet", str(tmp_path))
    assert second != first
    os.utime(folder / "wnids.txt", ns=(1, 1))
    assert dataset_fingerprint("tinyimagenet", str(tmp_path)) != second

    flowers = _fake_flowers(tmp_path)
    before = dataset_fingerprint("flowers102", str(tmp_path))
    (flowers / "jpg" / "image_00010.jpg").unlink()
    assert dataset_fingerprint("flowers102", str(tmp_path)) != before
    with pytest.raises(DataError, match="Tiny-ImageNet not found"):
        dataset_fingerprint("tinyimagenet", str(tmp_path / "nowhere"))


@pytest.mark.parametrize("dataset", ["tinyimagenet", "flowers102"])
def test_jpeg_dataset_partition_cache(tmp_path, dataset):
    (_fake_tiny if dataset == "tinyimagenet" else _fake_flowers)(tmp_path / "data")
    cfg = DataConfig(dataset=dataset, root=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                     beta=1.0, min_samples_per_client=2)
    info = prepare_partition(cfg, 2, seed=0)
    assert os.path.basename(info.path).startswith(f"{dataset}-dirichlet-")
    classes = 3 if dataset == "tinyimagenet" else 102
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (classes, 3, 64, 2)
    total = 0
    for cid in range(2):
        split = load_client_split(info.path, cid)
        assert split.train_x.shape[1:] == (3, 64, 64) and split.test_x.shape[1:] == (3, 64, 64)
        assert split.train_x.dtype == torch.float32
        total += split.train_y.numel() + split.test_y.numel()
    assert total == (18 if dataset == "tinyimagenet" else 10)
    assert prepare_partition(cfg, 2, seed=0).path == info.path  # reused


def test_jpeg_dataset_names_in_config(tmp_path):
    from htfl_dist.config import load_config

    for name in ("tinyimagenet", "flowers102"):
        config = load_config(None, [f"data.dataset={name}", f"data.root={tmp_path}"])
        assert config.data.dataset == name


def test_unknown_dataset_is_config_error():
    with pytest.raises(ConfigError):
        load_dataset("mnist-ish", None)


# --------------------------------------------------------------------------- dataset registry


def test_the_built_in_datasets_are_registered_in_their_order():
    """The order messages list them in (registration order)."""
    assert dataset_names()[:5] == ["fmnist", "cifar10", "cifar100", "tinyimagenet", "flowers102"]


def test_registered_dataset_is_allowed_and_unknown_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_DATASETS", registry._DATASETS.copy())  # undone after the test
    source_file = tmp_path / "toy.bin"
    source_file.write_bytes(b"toy")
    labels = np.arange(40, dtype=np.int64) % 2
    images = np.repeat(labels.astype(np.uint8)[:, None, None, None], 4, axis=2).repeat(4, axis=3)

    def load(root):
        assert root == str(tmp_path)
        return DatasetArrays(images=images, labels=labels, num_classes=2, name="toy")

    register_dataset(DatasetSource(name="toy", num_classes=2, files=lambda root: [str(source_file)],
                                   load=load, default_root=str(tmp_path)))
    assert dataset_names()[-1] == "toy" and "fmnist" in dataset_names()
    assert load_dataset("toy", None).name == "toy"  # the default root
    assert dataset_files("toy", None) == [str(source_file)]
    stat = os.stat(source_file)
    assert dataset_fingerprint("toy", None) == [["toy.bin", 3, stat.st_mtime_ns]]
    info = prepare_partition(DataConfig(dataset="toy", cache_dir=str(tmp_path / "cache"), beta=1.0,
                                        min_samples_per_client=2), 2, seed=0)
    assert os.path.basename(info.path).startswith("toy-dirichlet-") and info.num_classes == 2

    expected = ("config key 'data.dataset' is 'mnist-ish'; "
                "registered: fmnist, cifar10, cifar100, tinyimagenet, flowers102, digit5, domainnet, "
                f"toy ({PLUGIN_HINT})")
    from htfl_dist.resolution import resolved_config

    resolved = resolved_config(None, ["data.dataset=toy", f"data.root={tmp_path}"])  # a registered source is named
    assert resolved.data.dataset == "toy"
    for entry in (load_dataset, dataset_files, dataset_fingerprint):
        with pytest.raises(ConfigError) as exc:
            entry("mnist-ish", None)
        assert _one_line(exc) == expected


def test_unknown_dataset_message_is_the_configs():
    """The resolution step and the registry refuse an unknown dataset with the same line."""
    from htfl_dist.resolution import resolved_config

    with pytest.raises(ConfigError) as from_config:
        resolved_config(None, ["data.dataset=mnist-ish"])
    with pytest.raises(ConfigError) as from_registry:
        load_dataset("mnist-ish", None)
    assert _one_line(from_config) == _one_line(from_registry) == (
        "config key 'data.dataset' is 'mnist-ish'; registered: fmnist, cifar10, cifar100, tinyimagenet, flowers102, "
        "digit5, domainnet "
        f"({PLUGIN_HINT})")


def test_duplicate_dataset_registration_fails(monkeypatch):
    monkeypatch.setattr(registry, "_DATASETS", registry._DATASETS.copy())
    before = dataset_names()
    with pytest.raises(ValueError, match="dataset 'cifar10' is already registered"):
        register_dataset(DatasetSource(name="cifar10", num_classes=10, files=lambda root: [],
                                       load=lambda root: None))
    assert dataset_names() == before and dataset_source("cifar10").num_classes == 10


# --------------------------------------------------------------------------- pathological


@pytest.mark.parametrize("num_clients,k", [(20, 2), (7, 3), (3, 10), (4, 1)])
def test_pathological_exact_classes_non_redundant(num_clients, k):
    labels = _synthetic_labels(300, 10)
    parts = partition_pathological(labels, num_clients, k, 10, np.random.default_rng(1))
    assert len(parts) == num_clients
    used_classes = set()
    for i, part in enumerate(parts):
        classes = set(np.unique(labels[part]).tolist())
        assert classes == {(i * k + j) % 10 for j in range(k)}
        used_classes |= classes
    everything = np.concatenate(parts)
    assert everything.size == np.unique(everything).size  # no sample to two clients
    covered = np.flatnonzero(np.isin(labels, sorted(used_classes)))
    assert np.array_equal(np.sort(everything), covered)  # all samples of used classes


def test_pathological_is_unbalanced_and_classes_even():
    labels = _synthetic_labels(500, 10)
    parts = partition_pathological(labels, 20, 2, 10, np.random.default_rng(2))
    sizes = np.array([p.size for p in parts])
    assert sizes.min() >= 2 and len(set(sizes.tolist())) > 10
    per_class_holders = np.zeros(10, int)
    for p in parts:
        per_class_holders[np.unique(labels[p])] += 1
    assert per_class_holders.max() - per_class_holders.min() <= 1
    # The floor share: each holder of a class gets >= n // (10 m) of it.
    for p in parts:
        assert np.bincount(labels[p], minlength=10).max() >= 500 // (10 * 4)


def test_pathological_rejects_too_many_classes():
    with pytest.raises(ConfigError, match="classes_per_client") as exc:
        partition_pathological(_synthetic_labels(10, 10), 5, 11, 10, np.random.default_rng(0))
    _one_line(exc)


def test_pathological_class_smaller_than_its_holders():
    labels = _synthetic_labels(3, 10)  # 30 samples; 25 clients x 2 classes: 5 holders a class
    with pytest.raises(DataError, match="class 0 has 3 samples"):
        partition_pathological(labels, 25, 2, 10, np.random.default_rng(0))


def test_more_clients_than_samples_is_refused_before_allocating():
    labels = _synthetic_labels(3, 10)  # 30 samples
    for partition in (lambda: partition_pathological(labels, 31, 2, 10, np.random.default_rng(0)),
                      lambda: partition_dirichlet(labels, 10**9, 0.1, 10, np.random.default_rng(0))):
        with pytest.raises(ConfigError, match=r"config key 'num_clients' is .*, but the data has 30 samples"):
            partition()
    partition_pathological(labels, 10, 1, 10, np.random.default_rng(0))  # 10 clients, one class each: fine


# --------------------------------------------------------------------------- dirichlet


def test_dirichlet_deterministic_by_seed_and_covers_all():
    labels = _synthetic_labels(200, 10)
    a = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(0, "partition"))
    b = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(0, "partition"))
    c = partition_dirichlet(labels, 20, 0.1, 10, numpy_rng(1, "partition"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(x.size != y.size or not np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    everything = np.concatenate(a)
    assert np.array_equal(np.sort(everything), np.arange(labels.size))  # each sample once


@pytest.mark.parametrize("beta,min_samples", [(0.1, 10), (0.05, 25), (1.0, 50)])
def test_dirichlet_min_size(beta, min_samples):
    labels = _synthetic_labels(200, 10)
    parts = partition_dirichlet(labels, 20, beta, 10, np.random.default_rng(5),
                                min_samples=min_samples)
    assert min(p.size for p in parts) >= min_samples


def test_dirichlet_small_beta_is_non_iid():
    labels = _synthetic_labels(500, 10)
    parts = partition_dirichlet(labels, 10, 0.1, 10, np.random.default_rng(3))
    dominant = [np.bincount(labels[p], minlength=10).max() / p.size for p in parts]
    assert np.mean(dominant) > 0.4


def test_dirichlet_impossible_request_fails_fast():
    labels = _synthetic_labels(60, 10)  # 600 samples: 500 clients x 10 cannot fit
    start = time.perf_counter()
    with pytest.raises(DataError) as exc:
        partition_dirichlet(labels, 500, 0.1, 10, np.random.default_rng(0))
    assert time.perf_counter() - start < 1.0
    text = _one_line(exc)
    assert "Dirichlet partition (beta=0.1) cannot give 500 clients at least 10 samples" in text
    assert "lower num_clients or data.min_samples_per_client" in text


def test_dirichlet_gives_up_after_max_tries():
    labels = _synthetic_labels(50, 10)  # 500 samples, 50 clients x 10 is barely feasible
    start = time.perf_counter()
    with pytest.raises(DataError) as exc:
        partition_dirichlet(labels, 50, 0.01, 10, np.random.default_rng(0))
    assert time.perf_counter() - start < 30.0  # ~1 s alone; a bound on a runaway loop, not a timing (loaded CI)
    assert _one_line(exc) == (
        "Dirichlet partition (beta=0.01) left a client with fewer than 10 samples after 1000 "
        "tries; raise data.beta, lower num_clients or data.min_samples_per_client"
    )
    with pytest.raises(DataError, match="after 7 tries"):
        partition_dirichlet(labels, 50, 0.01, 10, np.random.default_rng(0), max_tries=7)


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_dirichlet_rejects_non_positive_beta(beta):
    with pytest.raises(ConfigError, match=r"data\.beta"):
        partition_dirichlet(_synthetic_labels(10, 10), 2, beta, 10, np.random.default_rng(0))


# --------------------------------------------------------------------------- split, subsample


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 10, 99, 100, 1001])
def test_split_sizes(n):
    indices = np.arange(1000, 1000 + n)
    train, test = split_train_test(indices, 0.75, np.random.default_rng(n))
    # Documented rounding: train = floor(0.75 n), clamped to [1, n-1] when n >= 2.
    expected = {0: 0, 1: 1, 2: 1, 3: 2, 4: 3, 5: 3, 7: 5, 10: 7, 99: 74, 100: 75, 1001: 750}[n]
    assert train.size == expected == train_count(n, 0.75)
    assert test.size == n - expected
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)


def test_split_shuffles():
    train, _ = split_train_test(np.arange(1000), 0.75, np.random.default_rng(0))
    assert not np.array_equal(train, np.arange(750))


def test_subsample_is_stratified():
    labels = np.repeat(np.arange(4), [100, 200, 40, 7])
    picked = subsample_indices(labels, 0.1, np.random.default_rng(0))
    assert np.array_equal(np.bincount(labels[picked], minlength=4), [10, 20, 4, 1])
    assert picked.size == np.unique(picked).size
    assert np.array_equal(subsample_indices(labels, 1.0, np.random.default_rng(0)),
                          np.arange(labels.size))


# --------------------------------------------------------------------------- cache


def _cfg(tmp_path, **overrides) -> DataConfig:
    base = dict(cache_dir=str(tmp_path / "cache"), subsample=0.05)
    base.update(overrides)
    return DataConfig(**base)


def _read_all(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visit(lambda name: out.__setitem__(name, f[name][()]) if isinstance(f[name], h5py.Dataset) else None)
        attrs = dict(f.attrs)
    return out, attrs


@needs_fmnist
def test_prepare_partition_builds_once_and_is_deterministic(tmp_path):
    cfg = _cfg(tmp_path)
    info = prepare_partition(cfg, 10, seed=3)
    assert isinstance(info, PartitionInfo)
    name = os.path.basename(info.path)
    assert name.startswith("fmnist-dirichlet-") and name.endswith(".h5")
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (10, 1, 28, 10)
    assert info.class_counts.shape == (10, 10)
    first_stat = os.stat(info.path)
    contents, attrs = _read_all(info.path)

    again = prepare_partition(cfg, 10, seed=3)  # reused, not rewritten
    assert again.path == info.path
    assert os.stat(info.path).st_ino == first_stat.st_ino
    assert os.stat(info.path).st_mtime_ns == first_stat.st_mtime_ns

    os.remove(info.path)  # rebuilt from scratch: same content
    rebuilt = prepare_partition(cfg, 10, seed=3)
    assert rebuilt.path == info.path
    contents2, attrs2 = _read_all(rebuilt.path)
    assert contents.keys() == contents2.keys()
    assert all(np.array_equal(contents[k], contents2[k]) for k in contents)
    assert attrs == attrs2
    assert attrs["dataset"] == "fmnist" and attrs["num_clients"] == 10
    assert sorted(os.listdir(tmp_path / "cache")) == [name]  # no temp files left

    # 5 % of 70000, stratified, split 75/25 per client; every client meets the minimum.
    total = sum(contents[f"client_{c}/train_y"].size + contents[f"client_{c}/test_y"].size
                for c in range(10))
    assert total == 3500
    for c in range(10):
        n_train = contents[f"client_{c}/train_y"].size
        n_test = contents[f"client_{c}/test_y"].size
        assert n_train + n_test >= 10 and n_train == train_count(n_train + n_test, 0.75)
        assert np.array_equal(np.bincount(contents[f"client_{c}/train_y"], minlength=10),
                              info.class_counts[c])
    assert np.array_equal(read_partition_info(info.path).class_counts, info.class_counts)


@needs_fmnist
def test_cache_key_covers_split_inputs(tmp_path):
    base = prepare_partition(_cfg(tmp_path), 6, seed=0).path
    assert prepare_partition(_cfg(tmp_path), 6, seed=1).path != base
    assert prepare_partition(_cfg(tmp_path), 5, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, beta=0.5), 6, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, train_ratio=0.8), 6, seed=0).path != base
    assert prepare_partition(_cfg(tmp_path, subsample=0.04), 6, seed=0).path != base
    # A knob that does not change the split does not change the file.
    assert prepare_partition(_cfg(tmp_path, classes_per_client=3), 6, seed=0).path == base


@needs_fmnist
def test_pathological_cache_and_client_split(tmp_path):
    cfg = _cfg(tmp_path, partition="pathological", classes_per_client=2)
    info = prepare_partition(cfg, 8, seed=0)
    assert os.path.basename(info.path).startswith("fmnist-pathological-")
    assert ((info.class_counts > 0).sum(axis=1) == 2).all()
    split = load_client_split(info.path, 5)
    assert isinstance(split, ClientSplit) and split.client_id == 5
    assert split.train_x.dtype == torch.float32 and split.test_x.dtype == torch.float32
    assert split.train_y.dtype == torch.int64 and split.test_y.dtype == torch.int64
    assert split.train_x.shape[1:] == (1, 28, 28) and split.test_x.shape[1:] == (1, 28, 28)
    assert split.train_x.shape[0] == split.train_y.shape[0] == info.class_counts[5].sum()
    assert split.train_x.min() >= -1.0 and split.train_x.max() <= 1.0
    assert split.train_x.min() < -0.99 and split.train_x.max() > 0.5
    # PFLlib's rule (the default): each class goes to the first ceil(8 / 10 * 2) = 2 clients with a
    # free slot, so clients 2j and 2j + 1 share classes 2j and 2j + 1: client 5 holds {4, 5}
    assert set(torch.unique(split.train_y).tolist()) == {4, 5}
    # legacy rule: classes dealt cyclically, client i holds {2i, 2i + 1} mod 10
    legacy = prepare_partition(_cfg(tmp_path, partition="pathological", classes_per_client=2,
                                    partition_rules="legacy"), 8, seed=0)
    assert set(torch.unique(load_client_split(legacy.path, 5).train_y).tolist()) == {0, 1}
    # Normalisation as PFLlib: x / 255, then (x - 0.5) / 0.5.
    with h5py.File(info.path, "r") as f:
        raw = f["client_5/train_x"][()]
    assert raw.dtype == np.uint8
    expected = (torch.from_numpy(raw).float() / 255.0 - 0.5) / 0.5
    assert torch.equal(split.train_x, expected)
    with pytest.raises(DataError, match="not 8"):
        load_client_split(info.path, 8)


@needs_fmnist
def test_pathological_too_many_classes_via_prepare(tmp_path):
    with pytest.raises(ConfigError, match="only 10 classes"):
        prepare_partition(_cfg(tmp_path, partition="pathological", classes_per_client=11), 4, 0)


def _build_in_child(cfg, queue):
    try:
        queue.put(prepare_partition(cfg, 4, seed=9).path)
    except BaseException as exc:  # pragma: no cover - reported by the parent
        queue.put(repr(exc))


@needs_fmnist
def test_concurrent_builders_and_corrupt_cache(tmp_path):
    cfg = _cfg(tmp_path, subsample=0.02)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_build_in_child, args=(cfg, queue)) for _ in range(3)]
    for child in children:
        child.start()
    results = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert len(set(results)) == 1 and results[0].endswith(".h5"), results
    path = results[0]
    assert os.listdir(tmp_path / "cache") == [os.path.basename(path)]
    assert prepare_partition(cfg, 4, seed=9).path == path
    reference, _ = _read_all(path)
    with open(path, "wb") as handle:  # damaged by hand: rebuilt, not trusted
        handle.write(b"not hdf5")
    assert prepare_partition(cfg, 4, seed=9).path == path
    rebuilt, _ = _read_all(path)
    assert all(np.array_equal(reference[k], rebuilt[k]) for k in reference)


def test_missing_dataset_via_prepare(tmp_path):
    cfg = DataConfig(root=str(tmp_path / "none"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="Fashion-MNIST not found"):
        prepare_partition(cfg, 4, 0)


# --------------------------------------------------------------------------- PFLlib


def _fake_pfllib(directory, num_clients=3, num_classes=4, shape=(1, 8, 8)):
    rng = np.random.default_rng(0)
    (directory / "train").mkdir(parents=True)
    (directory / "test").mkdir()
    written = {}
    for cid in range(num_clients):
        for part, n in (("train", 6 + cid), ("test", 2 + cid)):
            x = ((rng.random((n, *shape)) - 0.5) / 0.5).astype(np.float32)
            y = rng.integers(0, num_classes, n).astype(np.int64)
            np.savez_compressed(directory / part / f"{cid}.npz", data={"x": x, "y": y})
            written[(cid, part)] = (x, y)
    config = {"num_clients": num_clients, "num_classes": num_classes, "non_iid": True,
              "balance": False, "partition": "dir", "alpha": 0.1, "batch_size": 10}
    (directory / "config.json").write_text(json.dumps(config))
    return written


def test_pfllib_reader(tmp_path):
    source = tmp_path / "Cifar10"
    written = _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True,
                     cache_dir=str(tmp_path / "cache"))
    info = prepare_partition(cfg, 3, seed=0)
    assert os.path.basename(info.path).startswith("Cifar10-pfllib-")
    assert (info.num_classes, info.in_channels, info.image_size, info.num_clients) == (4, 1, 8, 3)
    for cid in range(3):
        split = load_client_split(info.path, cid)
        x, y = written[(cid, "train")]
        assert split.train_x.dtype == torch.float32
        assert torch.equal(split.train_x, torch.from_numpy(x))  # already normalised: as is
        assert torch.equal(split.train_y, torch.from_numpy(y))
        tx, ty = written[(cid, "test")]
        assert torch.equal(split.test_x, torch.from_numpy(tx))
        assert torch.equal(split.test_y, torch.from_numpy(ty))
        assert np.array_equal(info.class_counts[cid], np.bincount(y, minlength=4))
    assert prepare_partition(cfg, 3, seed=5).path == info.path  # seed does not matter


def test_pfllib_needs_allow_pickle(tmp_path):
    source = tmp_path / "fmnist_pfl"
    _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as exc:
        prepare_partition(cfg, 3, seed=0)
    text = _one_line(exc)
    assert "PFLlib .npz files hold pickled Python objects" in text
    assert f"set data.allow_pickle=true if you trust {source}" in text
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


def test_pfllib_file_whose_pickle_is_corrupt_is_one_line(tmp_path):
    """allow_pickle=true was given, but the pickle inside names a module that does not exist."""
    import io
    import zipfile

    source = tmp_path / "pfl"
    _fake_pfllib(source)
    victim = source / "train" / "1.npz"
    payload = io.BytesIO()  # an object .npy: header, then a pickle (GLOBAL no_such_module.Thing)
    np.lib.format.write_array_header_1_0(payload, {"descr": "|O", "fortran_order": False, "shape": ()})
    payload.write(b"\x80\x02cno_such_module\nThing\n.")
    with zipfile.ZipFile(victim, "w") as archive:
        archive.writestr("data.npy", payload.getvalue())
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"1\.npz") as exc:
        prepare_partition(cfg, 3, seed=0)
    assert "replace the file" in _one_line(exc)


def test_pfllib_num_clients_mismatch_and_missing_files(tmp_path):
    source = tmp_path / "pfl"
    _fake_pfllib(source)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True,
                     cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="set num_clients=3") as exc:
        prepare_partition(cfg, 4, seed=0)
    _one_line(exc)
    os.remove(source / "test" / "1.npz")
    with pytest.raises(DataError, match=r"lacks test/1\.npz"):
        prepare_partition(cfg, 3, seed=0)
    with pytest.raises(DataError, match="does not exist"):
        prepare_partition(DataConfig(partition="pfllib", pfllib_dir=str(tmp_path / "x"),
                                     allow_pickle=True, cache_dir=str(tmp_path / "c")), 3, 0)


def _pfllib_error(source, tmp_path) -> str:
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as exc:
        prepare_partition(cfg, 3, seed=0)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*.h5")), "no cache is left"
    return _one_line(exc)


def _set_num_classes(source, num_classes: int) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_classes": num_classes}))


def test_pfllib_num_classes_beyond_the_cap_is_refused_before_anything_is_read(tmp_path):
    """config.json's num_classes sizes the class-count table (a billion: 44.7 GiB) and every head."""
    source = tmp_path / "pfl"
    _fake_pfllib(source)
    _set_num_classes(source, 1_000_000_000)
    (source / "train" / "0.npz").write_bytes(b"not read")  # refused before any client file is opened
    assert _pfllib_error(source, tmp_path) == (
        f"PFLlib directory {source}: config.json num_classes=1000000000 exceeds 100000, the most classes "
        f"accepted; correct config.json (PFLlib's generators write the dataset's class count there)")


def test_pfllib_num_classes_far_above_the_labels_is_refused(tmp_path):
    """Labels 0..3 and num_classes 5000: a typo or another dataset's config.json (at most
    max(1000, 10 x (largest label + 1)) is accepted; 1000 is, whatever the labels)."""
    source = tmp_path / "pfl"
    largest = max(int(y.max()) for _, y in _fake_pfllib(source).values())
    _set_num_classes(source, 5000)
    assert _pfllib_error(source, tmp_path) == (
        f"PFLlib directory {source}: config.json num_classes=5000 exceeds 1000, the most accepted when the "
        f"largest label is {largest} (10 x {largest + 1} classes, at least 1000); correct config.json to the "
        f"dataset's class count")
    _set_num_classes(source, 1000)
    cfg = DataConfig(partition="pfllib", pfllib_dir=str(source), allow_pickle=True, cache_dir=str(tmp_path / "c"))
    assert prepare_partition(cfg, 3, seed=0).num_classes == 1000


def test_pfllib_label_outside_num_classes_names_it(tmp_path):
    source = tmp_path / "pfl"
    _fake_pfllib(source)
    x = np.zeros((3, 1, 8, 8), dtype=np.float32)
    np.savez_compressed(source / "test" / "2.npz", data={"x": x, "y": np.array([1, -1, 2])})
    assert _pfllib_error(source, tmp_path) == (f"{source / 'test' / '2.npz'}: label -1 in y is outside 0..3 "
                                               f"(config.json says num_classes=4)")
