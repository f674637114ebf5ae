"""Tiny-ImageNet from the extracted ``tiny-imagenet-200.zip``: train (100,000) + val (10,000)
64 x 64 JPEGs; the official test split has no labels and is not read."""
from __future__ import annotations

import os

import numpy as np

from htfl_dist.errors import DataError

from .jpeg import JpegSet, decode_images, digest, dir_entry, file_entry, jpeg_folder, jpeg_names
from .registry import DatasetArrays, DatasetSource, register_dataset

IMAGE_SIZE = 64
"""Side of the square uint8 images. Tiny-ImageNet images are 64 x 64 already (any other size is
an error)."""

TINY = JpegSet(
    name="tinyimagenet",
    title="Tiny-ImageNet",
    folder="tiny-imagenet-200",
    marker="wnids.txt",
    required=("wnids.txt", "train/", "val/images/", "val/val_annotations.txt"),
    get="unzip http://cs231n.stanford.edu/tiny-imagenet-200.zip in DIR",
    fix="re-extract tiny-imagenet-200.zip",
)


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
    names = jpeg_names(images_dir)
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
        names = jpeg_names(directory)
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
    folder = jpeg_folder(TINY, root)
    wnids = _tiny_wnids(folder)
    dirs = [os.path.join(folder, "train", w, "images") for w in wnids]
    return [os.path.join(folder, "wnids.txt"), os.path.join(folder, "val", "val_annotations.txt"),
            os.path.join(folder, "val", "images"), *dirs]


def tinyimagenet_fingerprint(root: str | None) -> list[list]:
    """Metadata files, val/images and the 200 class folders folded into one digest."""
    folder = jpeg_folder(TINY, root)
    wnids = _tiny_wnids(folder)
    class_dirs = []
    for wnid in wnids:
        rel = f"train/{wnid}/images"
        if not os.path.isdir(os.path.join(folder, rel)):
            _tiny_train(folder, [wnid])  # raises the DataError naming the folder
        class_dirs.append(dir_entry(folder, rel))
    return [
        ["preprocess", "RGB", IMAGE_SIZE, "no-resize"],
        file_entry(folder, "wnids.txt"),
        file_entry(folder, "val/val_annotations.txt"),
        dir_entry(folder, "val/images"),
        ["train/*/images/", sum(e[1] for e in class_dirs), digest(class_dirs)],
    ]


def load_tinyimagenet(root: str | None) -> DatasetArrays:
    """train (100,000) + val (10,000) images; the official test split has no labels."""
    folder = jpeg_folder(TINY, root)
    wnids = _tiny_wnids(folder)
    index = {w: i for i, w in enumerate(wnids)}
    train_paths, train_labels = _tiny_train(folder, wnids)
    val_paths, val_labels = _tiny_val(folder, index)
    images = decode_images(train_paths + val_paths, IMAGE_SIZE, resize=False, fix=TINY.fix)
    labels = np.asarray(train_labels + val_labels, dtype=np.int64)
    return DatasetArrays(images=images, labels=labels, num_classes=len(wnids), name="tinyimagenet")


register_dataset(DatasetSource(
    name="tinyimagenet", num_classes=200, files=tinyimagenet_files, load=load_tinyimagenet,
    fingerprint=tinyimagenet_fingerprint,
))
