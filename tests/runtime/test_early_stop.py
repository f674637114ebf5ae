"""Early stopping (stop.*): the count of evaluated rounds without improvement, by hand, and a run
that ends on it with exit 0, a summary that says why, and the same config hash."""
from __future__ import annotations

import json

import pytest

from conftest import SMOKE, read_metrics, run_program
from htfl_dist.config import load_config
from htfl_dist.runtime.records import early_stop_due


def _rows(metric: str, values: list) -> list[dict]:
    return [{"round": r, metric: v} for r, v in enumerate(values, start=1)]


def test_patience_counts_evaluated_rows_since_the_best_beyond_min_delta():
    rows = _rows("test_acc", [0.5, 0.6, 0.6, 0.59, 0.605])  # 0.605 − 0.6 is not more than 0.01
    due = early_stop_due(rows, "test_acc", patience=3, min_delta=0.01)
    assert due == {"after_round": 5, "metric": "test_acc", "best": 0.6, "best_round": 2, "patience": 3,
                   "min_delta": 0.01}
    assert early_stop_due(rows, "test_acc", patience=4, min_delta=0.01) is None
    assert early_stop_due(rows, "test_acc", patience=3, min_delta=0.0) is None  # 0.605 improves: 0 since
    assert early_stop_due(rows, "test_acc", patience=0, min_delta=0.0) is None  # off
    flat = _rows("test_acc", [0.5, 0.6, 0.6, 0.6])  # an equal value is no improvement, even at min_delta 0
    assert early_stop_due(flat, "test_acc", patience=2, min_delta=0.0)["best_round"] == 2


def test_the_training_loss_must_go_down_and_withheld_values_do_not_count():
    rows = _rows("train_loss", [2.0, 1.5, None, 1.6, float("nan"), 1.55])
    due = early_stop_due(rows, "train_loss", patience=2, min_delta=0.0)
    assert due is not None and due["best"] == 1.5 and due["best_round"] == 2
    assert early_stop_due(_rows("train_loss", [None, None]), "train_loss", 1, 0.0) is None


@pytest.mark.integration
def test_a_run_ends_on_its_patience_with_exit_0_and_says_why(tmp_path, cache_dir):
    # no accuracy can improve by more than 1: the best stays round 1's, and patience 1 ends round 2
    args = ["--config", str(SMOKE), "--out", str(tmp_path / "run"), f"data.cache_dir={cache_dir}", "rounds=4",
            "stop.patience=1", "stop.min_delta=1"]
    result = run_program(args)
    assert result.returncode == 0, result.stderr
    assert [row["round"] for row in read_metrics(tmp_path / "run")] == [1, 2]
    assert "early stop after round 2: test_acc has not improved" in result.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"]["after_round"] == 2 and summary["stopped_early"]["best_round"] == 1
    # when to stop is not the experiment: the hash is the run's without it
    assert load_config(SMOKE, ["stop.patience=1"]).config_hash() == load_config(SMOKE, []).config_hash()
