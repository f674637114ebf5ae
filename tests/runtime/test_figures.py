"""Pictures from runs: prototype snapshots written by rank 0 and read back, the PCA projection,
FedTGP's Fig. 1 from the logged margins, and identical curves marked in the run report."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO, SMOKE, _env, read_metrics, run_program
from htfl_dist.metrics.figures import pca_2d, spread_rounds
from htfl_dist.metrics.prototypes import load_snapshot, snapshot, snapshot_rounds
from htfl_dist.metrics.report import RunRecord, identical_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_pca_of_points_on_a_line_keeps_their_distances_and_flattens_the_rest():
    points = torch.tensor([[0.0, 1.0, 1.0], [2.0, 1.0, 1.0], [4.0, 1.0, 1.0]])
    xy = pca_2d(points)
    assert xy[:, 0].abs().tolist() == pytest.approx([2.0, 0.0, 2.0])
    assert xy[0, 0] == pytest.approx(-xy[2, 0])
    assert xy[:, 1].abs().max().item() == pytest.approx(0.0, abs=1e-12)


def test_default_rounds_are_first_last_and_evenly_between():
    assert spread_rounds([5, 10, 15]) == [5, 10, 15]
    assert spread_rounds(list(range(1, 11))) == [1, 4, 7, 10]


def test_identical_curves_are_grouped():
    def run(name, accuracies):
        rows = [{"round": r + 1, "test_acc": a} for r, a in enumerate(accuracies)]
        return RunRecord(REPO / "runs" / name, {}, None, rows)

    runs = [run("a", [0.1, 0.2]), run("b", [0.1, 0.3]), run("c", [0.1, 0.2]), run("empty", [None])]
    assert identical_curves(runs, "test_acc") == [["a", "c"], ["b"]]


def test_snapshot_flattens_uploads_in_client_order():
    uploads = {
        7: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[7.0, 7.0]])},
        3: {"class_ids": torch.tensor([0, 2]), "protos": torch.tensor([[3.0, 0.0], [3.0, 2.0]])},
    }
    download = {"class_ids": torch.tensor([0, 1, 2]), "anchors": torch.eye(3, 2), "counts": torch.ones(3)}
    snap = snapshot(uploads, download)
    assert snap["upload_client_ids"].tolist() == [3, 3, 7]
    assert snap["upload_class_ids"].tolist() == [0, 2, 2]
    assert snap["upload_protos"].tolist() == [[3.0, 0.0], [3.0, 2.0], [7.0, 7.0]]
    assert snap["global_class_ids"].tolist() == [0, 1, 2]
    assert torch.equal(snap["global_anchors"], torch.eye(3, 2))
    assert "global_protos" not in snap and "global_counts" not in snap


@pytest.fixture(scope="module")
def fedtgp_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("figures-fedtgp")
    result = run_program(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                         "algorithm=fedtgp", "rounds=2", "output.prototypes_every=2"])
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_snapshots_hold_what_was_exchanged_in_the_chosen_rounds(fedtgp_run):
    assert snapshot_rounds(fedtgp_run) == [2]  # every 2nd round only
    snap = load_snapshot(fedtgp_run, 2)
    row = read_metrics(fedtgp_run)[1]
    width = snap["upload_protos"].shape[1]
    assert snap["upload_protos"].shape[0] * width * 4 == row["bytes_theory_up"]  # one row per class held
    assert snap["upload_client_ids"].tolist() == sorted(snap["upload_client_ids"].tolist())
    assert snap["global_protos"].shape == (10, width) and snap["global_class_ids"].tolist() == list(range(10))
    assert torch.isfinite(snap["global_protos"]).all()


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "htfl_dist.report", *args], capture_output=True, text=True,
                          env=_env(), timeout=120)


@pytest.mark.launch
def test_report_draws_margins_and_prototypes_and_marks_identical_curves(fedtgp_run, tmp_path):
    margins, prototypes, curves = tmp_path / "m.png", tmp_path / "p.png", tmp_path / "c.png"
    result = _report(str(fedtgp_run), str(fedtgp_run), "--margins", str(margins), "--prototypes", str(prototypes),
                     "--plot", str(curves))
    assert result.returncode == 0, result.stderr
    for path in (margins, prototypes, curves):
        assert path.read_bytes()[:8] == PNG_MAGIC
    assert "identical test_acc curves, drawn as one line" in result.stderr


@pytest.mark.launch
def test_report_names_the_rounds_it_has(fedtgp_run, tmp_path):
    result = _report(str(fedtgp_run), "--prototypes", str(tmp_path / "p.png"), "--rounds", "1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("has no prototype snapshots "
                                                           "(run with output.prototypes_every=N) for round(s) 1; "
                                                           "it has: 2")
    assert not (tmp_path / "p.png").exists()


def test_prototype_snapshots_of_an_algorithm_without_prototypes_is_a_user_error(tmp_path, cache_dir):
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                         "algorithm=local", "rounds=1", "output.prototypes_every=1"])
    assert result.returncode == 2
    assert "'local' sends none" in result.stderr.strip().splitlines()[-1]
