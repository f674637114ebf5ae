"""Write data directories in PFLlib's on-disk layout, for measuring us beside the reference code on
a machine that can fetch nothing (bench/gpu_suite.py).

Both sides then read the same files: HtFLlib reads ``../dataset/<NAME>/{train,test}/<id>.npz``
from its ``system/`` folder, and we read the directory with ``data.partition=pfllib``.

    python bench/pfllib_write.py fmnist OUT/FMNIST --fmnist-root DIR [--clients 20] [--subsample 1]
    python bench/pfllib_write.py generated OUT/Cifar100 --clients 20 --classes 100 --samples 60000

``fmnist``: PFLlib's own split of Fashion-MNIST (Dirichlet β = 0.1, seed 1: the split PFLlib's
``generate_FMNIST.py noniid - dir`` writes), drawn by this project's reproduction of PFLlib's rules
(``data.partition_rules=pfllib``), stored as PFLlib stores it: float32 ``(x / 255 − 0.5) / 0.5``,
shape N × 1 × 28 × 28, int64 labels. ``generated``: random 3 × 32 × 32 pictures with CIFAR-100's
sizes (a class-dependent pattern under noise, so training learns something), Dirichlet-split the
same way; for timing paper-size models where the real CIFAR-100 cannot be fetched.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from htfl_dist.config import DataConfig
from htfl_dist.data.cache import load_client_split
from htfl_dist.data.partition_pfllib import pfllib_client_splits, pfllib_least_samples
from htfl_dist.data.prepare import prepare_partition


def save_client(directory: Path, part: str, client: int, x: np.ndarray, y: np.ndarray) -> None:
    """One ``<part>/<client>.npz`` as PFLlib's ``save_file`` writes it (a pickled dict under
    ``data``), uncompressed: these directories are scratch, and reading them is then faster."""
    (directory / part).mkdir(parents=True, exist_ok=True)
    with open(directory / part / f"{client}.npz", "wb") as handle:
        np.savez(handle, data={"x": x, "y": y})


def save_config(directory: Path, num_clients: int, num_classes: int, counts: list[list[list[int]]],
                beta: float = 0.1) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "num_clients": num_clients, "num_classes": num_classes, "non_iid": True, "balance": False,
        "partition": "dir", "alpha": beta, "batch_size": 10,
        "Size of samples for labels in clients": counts}))


def class_counts(y: np.ndarray) -> list[list[int]]:
    labels, counts = np.unique(y, return_counts=True)
    return [[int(label), int(count)] for label, count in zip(labels, counts, strict=True)]


def write_fmnist(out: Path, fmnist_root: str | None, num_clients: int, subsample: float, beta: float = 0.1) -> None:
    """``fmnist_root`` None: the FMNIST this machine's default root holds (the OS package's)."""
    with tempfile.TemporaryDirectory() as cache:
        data = DataConfig(dataset="fmnist", root=fmnist_root, partition="dirichlet", partition_rules="pfllib",
                          partition_seed=1, beta=beta, subsample=subsample, cache_dir=cache)
        info = prepare_partition(data, num_clients, seed=0, batch_size=10)
        counts = []
        for client in range(num_clients):
            split = load_client_split(info.path, client)
            save_client(out, "train", client, split.train_x.numpy(), split.train_y.numpy())
            save_client(out, "test", client, split.test_x.numpy(), split.test_y.numpy())
            counts.append(class_counts(np.concatenate([split.train_y.numpy(), split.test_y.numpy()])))
        save_config(out, num_clients, info.num_classes, counts, beta)


def generated_images(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """3 × 32 × 32 float32 pictures: each class a fixed random pattern, each picture that pattern
    plus unit Gaussian noise (normalised like PFLlib's CIFAR: roughly zero mean, unit spread)."""
    patterns = rng.standard_normal((num_classes, 3, 32, 32), dtype=np.float32)
    images = rng.standard_normal((len(labels), 3, 32, 32), dtype=np.float32)
    images += patterns[labels]
    return images


def write_generated(out: Path, num_clients: int, num_classes: int, samples: int) -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(num_classes), samples // num_classes)
    splits = pfllib_client_splits(labels, num_clients, num_classes, partition="dirichlet", seed=1,
                                  least_samples=pfllib_least_samples(len(labels), num_clients, 10, 0.75),
                                  train_ratio=0.75, beta=0.1)
    counts = []
    for client, (train, test) in enumerate(splits):
        for part, rows in (("train", train), ("test", test)):
            save_client(out, part, client, generated_images(labels[rows], num_classes, rng), labels[rows])
        counts.append(class_counts(labels[np.concatenate([train, test])]))
    save_config(out, num_clients, num_classes, counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("fmnist", "generated"))
    parser.add_argument("out", type=Path, help="the directory to write (must not exist)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--fmnist-root", default=None, help="folder with FMNIST's four IDX files")
    parser.add_argument("--subsample", type=float, default=1.0, help="fmnist: this share of the samples")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--samples", type=int, default=60000)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; name a new directory")
    partial = args.out.with_name(args.out.name + ".partial")
    if args.kind == "fmnist":
        write_fmnist(partial, args.fmnist_root, args.clients, args.subsample)
    else:
        write_generated(partial, args.clients, args.classes, args.samples)
    os.replace(partial, args.out)  # a directory is there whole or not at all
    print(f"wrote {args.out} ({args.clients} clients)")


if __name__ == "__main__":
    main()
