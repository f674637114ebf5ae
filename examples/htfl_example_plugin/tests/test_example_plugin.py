"""The example plugin's own suite: the engine's conformance kit run on its algorithm (one
parametrised test), its dataset and model read back, and the engine's program and study runner
driven through their command lines, as a user drives them. It runs with the plugin installed
(its entry point registers it) or on PYTHONPATH."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import htfl_example_plugin
import numpy as np
import pytest
import torch

from htfl_dist.api import ConformanceCase, build_model, conformance_cases, launch_env, load_dataset, members_in_use

HERE = Path(__file__).resolve().parents[1]
CONFIG = HERE / "example.yaml"


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes4")
    htfl_example_plugin.write_shapes4(root, samples=600)
    return root


def _settings(root: Path, tmp: Path) -> list[str]:
    return [f"data.root={root}", f"data.cache_dir={tmp / 'cache'}", "rounds=2"]


@pytest.mark.parametrize("case", conformance_cases(["example_fedper"]))
def test_conformance(case: ConformanceCase, data_root: Path, tmp_path: Path) -> None:
    """Every check the engine holds its own algorithms to, on this plugin's run (its config)."""
    case(tmp_path, config_file=CONFIG, overrides=_settings(data_root, tmp_path), imports=["htfl_example_plugin"])


def test_the_dataset_reads_back_what_was_written(data_root: Path) -> None:
    arrays = load_dataset("shapes4", str(data_root))
    assert arrays.images.shape == (600, 1, 16, 16) and arrays.images.dtype == np.uint8
    assert sorted(np.bincount(arrays.labels).tolist()) == [150, 150, 150, 150]


def test_the_group_gives_one_extractor_and_two_heads() -> None:
    assert members_in_use("example_tiny", 4) == ["tiny_cnn", "tiny_cnn:fc512"]
    model = build_model("tiny_cnn:fc512", num_classes=4, feature_dim=32, in_channels=1, image_size=16)
    assert model.feature_dim == 32 and model(torch.zeros(2, 1, 16, 16)).shape == (2, 4)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=launch_env(), capture_output=True, text=True,
                          timeout=900)


def test_the_program_runs_it_on_three_torchrun_ranks(data_root: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=3", "-m", "htfl_dist.main",
                             "--config", str(CONFIG), "--out", str(tmp_path / "run"), "--import", "htfl_example_plugin",
                             *_settings(data_root, tmp_path), "runtime.backend=gloo", "runtime.device=cpu"],
                            cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["best_test_acc"] > 0.5
    assert "htfl_example_plugin" in summary["versions"]["plugins"]


def test_a_two_cell_study_runs_it(data_root: Path, tmp_path: Path) -> None:
    result = _run(["-m", "htfl_dist.study", str(HERE / "study.yaml"), "--out", str(tmp_path / "study"),
                   "--import", "htfl_example_plugin", "--jobs", "2", "--set", *_settings(data_root, tmp_path)],
                  tmp_path)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "study" / "table.md").read_text()
    assert "| sample_weighted | 1 |" in table and "| uniform | 1 |" in table
