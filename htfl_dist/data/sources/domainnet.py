"""DomainNet (345 classes, six domains) from the folders PFLlib's ``dataset/generate_DomainNet.py``
reads (its ``rawdata/``: each domain's zip unzipped there, and the split lists beside them)::

    clipart/<class>/<image>.jpg ...   one folder per domain: clipart, infograph, painting,
    ...                               quickdraw, real, sketch
    splits/clipart_train.txt          one line per image: "clipart/<class>/<image>.jpg <label>"
    splits/clipart_test.txt           (labels 0..344)

Every image becomes uint8 3 x 64 x 64 (RGB, resized with PIL's bilinear filter, the aspect ratio
not kept: the generator's test transform ``Resize((64, 64))``; its training transform's random
crop and flip are augmentation and are not baked in), the train list's images then the test
list's. The fingerprint covers the two lists and each domain folder's entry count and mtime (as
for the other JPEG datasets, an image overwritten in place is not noticed).
"""
from __future__ import annotations

import os

import numpy as np

from htfl_dist.errors import DataError

from .domains import DomainSuite, missing_domain, register_suite, suite_root
from .jpeg import decode_images, dir_entry, file_entry

IMAGE_SIZE = 64
DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")  # PFLlib's order

GET = ("get each domain's zip and its splits/<domain>_train.txt and _test.txt as PFLlib's "
       "dataset/generate_DomainNet.py does (from csr.bu.edu/ftp/visda/2019/multi-source/) and unzip the "
       "zips into DIR")


def domainnet_folder(root: str | None) -> str:
    return suite_root(root, "domainnet", "DomainNet's domain folders and splits/", GET)


def _lists(domain: str) -> tuple[str, str]:
    return os.path.join("splits", f"{domain}_train.txt"), os.path.join("splits", f"{domain}_test.txt")


def domainnet_files(folder: str, domain: str) -> list[str]:
    wanted = [*_lists(domain), domain]
    missing = [rel + ("/" if rel == domain else "") for rel in wanted
               if not (os.path.isdir if rel == domain else os.path.isfile)(os.path.join(folder, rel))]
    if missing:
        raise missing_domain(SUITE, folder, domain, missing)
    return [os.path.join(folder, rel) for rel in wanted]


def domainnet_fingerprint(folder: str, domain: str) -> list[list]:
    train, test = _lists(domain)
    return [["preprocess", domain, "RGB", IMAGE_SIZE, "PIL-bilinear"],
            file_entry(folder, train), file_entry(folder, test), dir_entry(folder, domain)]


def _read_list(folder: str, rel: str) -> tuple[list[str], list[int]]:
    path = os.path.join(folder, rel)
    paths, labels = [], []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError
                label = int(fields[1])
            except ValueError:
                raise DataError(f"{path}:{number}: expected '<image path> <label>', got {line.strip()[:80]!r}; "
                                f"{GET}") from None
            paths.append(os.path.join(folder, fields[0]))
            labels.append(label)
    return paths, labels


def load_domainnet_domain(folder: str, domain: str) -> tuple[np.ndarray, np.ndarray]:
    domainnet_files(folder, domain)
    paths, labels = [], []
    for rel in _lists(domain):
        part_paths, part_labels = _read_list(folder, rel)
        paths += part_paths
        labels += part_labels
    images = decode_images(paths, IMAGE_SIZE, True, GET)
    return images, np.asarray(labels, dtype=np.int64)


SUITE = DomainSuite(
    name="domainnet",
    domains=DOMAINS,
    num_classes=345,
    image_size=IMAGE_SIZE,
    files=domainnet_files,
    load=load_domainnet_domain,
    folder=domainnet_folder,
    fingerprint=domainnet_fingerprint,
    get=GET,
)
register_suite(SUITE)
