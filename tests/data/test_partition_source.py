"""PartitionInfo.describe(): start-up lines name where the data really come from.

With data.partition=pfllib the config's data.dataset (default fmnist) names nothing that is read,
so the source must come from the cache file itself, also when the cache is reused.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from htfl_dist.config import DEFAULT_FMNIST_ROOT, DataConfig
from htfl_dist.data import PartitionInfo, prepare_partition


def _write_pfllib_directory(directory: Path, num_clients: int = 2) -> None:
    """The smallest directory PFLlib's generators could write: config.json, train/, test/."""
    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        (directory / part).mkdir(parents=True)
        for cid in range(num_clients):
            x = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
            y = rng.integers(0, 3, 4)
            np.savez_compressed(directory / part / f"{cid}.npz", data={"x": x, "y": y})
    (directory / "config.json").write_text(json.dumps({"num_clients": num_clients, "num_classes": 3}))


def test_a_pfllib_directory_is_named_by_its_absolute_path_not_by_data_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_pfllib_directory(tmp_path / "HAR split")
    data = DataConfig(dataset="cifar10", partition="pfllib", pfllib_dir="HAR split", allow_pickle=True,
                      cache_dir=str(tmp_path / "cache"))
    expected = f"PFLlib directory {os.path.join(os.getcwd(), 'HAR split')}"
    built = prepare_partition(data, 2, seed=0)
    assert built.describe() == expected
    assert built.dataset == "HAR_split"  # the cache's label, made safe for a file name
    reused = prepare_partition(data, 2, seed=0)  # read back from the finished cache
    assert reused.path == built.path
    assert reused.describe() == expected


@pytest.mark.skipif(not os.path.isdir(DEFAULT_FMNIST_ROOT), reason="apt-get install dataset-fashion-mnist")
def test_a_split_drawn_here_is_named_by_its_dataset(tmp_path):
    info = prepare_partition(DataConfig(subsample=0.01, cache_dir=str(tmp_path)), 3, seed=0)
    assert info.describe() == "fmnist"
    assert info.pfllib_dir == ""


def test_a_summary_built_by_hand_does_not_claim_a_dataset():
    info = PartitionInfo("unused", 2, 1, 28, 4, np.zeros((4, 2), np.int64))
    assert info.describe() == "data of unrecorded origin"
