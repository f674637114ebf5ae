"""Small learnable sensor and text directories in PFLlib's on-disk layout, for running FedProto
beside HtFLlib where the real HAR and AG News cannot be downloaded (bench/RESULTS.md).

Writes ``DIR/HAR`` (4 clients, 200 windows each, 9 x 1 x 128 float64 as generate_HAR.py writes
them, 6 classes: a per-class sine per channel under Gaussian noise of std 6, each client holding
4 classes) and ``DIR/SynNews`` (4 clients, 200 texts each, AG News pairs (ids padded with 0 to 32,
length 32), 4 classes: ids start with 2, then 8-40 words of which 8 % come from the class's own
40 ids and the rest from 36 shared ids; each client holding 3 classes). HtFLlib reads a text
directory only when its name contains "News". Usage: ``python bench/kinds_side_by_side_data.py DIR``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CLIENTS, SAMPLES, MAX_LEN, VOCAB = 4, 200, 32, 200


def save_file(directory: Path, clients: list[tuple[np.ndarray, np.ndarray]], num_classes: int,
              rng: np.random.Generator) -> None:
    """PFLlib's save_file after a shuffled 75/25 split per client."""
    (directory / "train").mkdir(parents=True)
    (directory / "test").mkdir()
    for cid, (x, y) in enumerate(clients):
        order = rng.permutation(len(y))
        x, y = x[order], y[order]
        cut = int(len(y) * 0.75)
        for part, rows in (("train", slice(0, cut)), ("test", slice(cut, None))):
            with open(directory / part / f"{cid}.npz", "wb") as handle:
                np.savez_compressed(handle, data={"x": x[rows], "y": y[rows]})
    (directory / "config.json").write_text(json.dumps(
        {"num_clients": len(clients), "num_classes": num_classes, "Size of samples for labels in clients": []}))


def sensor_clients(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    steps = np.arange(128)
    frequency, phase = rng.uniform(0.02, 0.2, (6, 9)), rng.uniform(0, 6.3, (6, 9))
    clients = []
    for _ in range(CLIENTS):
        y = rng.choice(rng.choice(6, 4, replace=False), SAMPLES).astype(np.int32)
        signal = np.sin(frequency[y][:, :, None] * steps + phase[y][:, :, None])
        x = signal + rng.standard_normal((SAMPLES, 9, 128)) * 6.0
        clients.append((x.reshape(SAMPLES, 9, 1, 128), y))
    return clients


def text_clients(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    clients = []
    for _ in range(CLIENTS):
        y = rng.choice(rng.choice(4, 3, replace=False), SAMPLES).astype(np.int64)
        pairs = []
        for label in y:
            count = int(rng.integers(8, 40))
            own = rng.integers(4 + 40 * label, 44 + 40 * label, count)
            shared = rng.integers(164, VOCAB, count)
            tokens = [2, *np.where(rng.random(count) < 0.08, own, shared).tolist()]
            tokens = (tokens + [0] * (MAX_LEN - len(tokens)))[:MAX_LEN]
            pairs.append((tokens, len(tokens)))
        clients.append((np.array(pairs, dtype=object), y))
    return clients


def main(directory: Path) -> None:
    rng = np.random.default_rng(7)
    save_file(directory / "HAR", sensor_clients(rng), 6, rng)
    save_file(directory / "SynNews", text_clients(rng), 4, rng)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
