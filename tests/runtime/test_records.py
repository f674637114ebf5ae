"""The round loop's records and stop decision, by hand: rank 0 turns hand-made round outcomes into
rows (no transport, no models), and decides at each round boundary from hand-made reports."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SMOKE
from htfl_dist.config import load_config
from htfl_dist.runtime.exchange import (
    DIVERGING,
    GIVE_UP,
    STOP,
    RankReport,
    RoundReports,
    RoundTraffic,
    StopDecision,
)
from htfl_dist.runtime.records import RoundOutcome, RoundRecords, per_client_row, pooled_auc


def _client(train: list[float] | None, evaluation: list[float] | None) -> dict[str, torch.Tensor]:
    def rows(values, width):
        return torch.tensor([values], dtype=torch.float64) if values else torch.empty(0, width, dtype=torch.float64)

    return {"train": rows(train, 2), "eval": rows(evaluation, 4), "privacy": rows(None, 1)}


def _outcome(round_index: int, evaluated: bool, skipped: list[int], losses=(2.0, 6.0)) -> RoundOutcome:
    """Two clients: client 0 trained on 10 samples (loss sum losses[0]) and got 3 of 4 test
    samples right (1 by the head); client 1 trained on 30 (loss sum losses[1]), 1 of 6 right."""
    evaluation = ([3.0, 1.0, 4.0, 0.75], [1.0, 5.0, 6.0, float("nan")]) if evaluated else (None, None)
    reports = RoundReports({0: _client([losses[0], 10.0], evaluation[0]), 1: _client([losses[1], 30.0], evaluation[1])},
                           [RankReport(0.5, 100.0, 0.0), RankReport(2.0, 300.0, 0.0), RankReport(1.0, 0.0, 0.0)])
    return RoundOutcome(round_index, [0, 1], evaluated, traffic=RoundTraffic(up=40, down=60), server_seconds=0.25,
                        diagnostics={"margin": 1.5}, skipped=skipped, reports=reports)


@pytest.fixture
def records(tmp_path):
    config = load_config(SMOKE, ["rounds=3", "eval_every=2"])
    records = RoundRecords(config, tmp_path, world_size=3)
    records.begin(1)
    yield records
    records.close()


def test_a_row_pools_accuracy_and_reports_the_skips_of_rounds_without_a_row(records, tmp_path, capsys):
    records.count_setup_upload(RoundTraffic(up=7))
    records.record(_outcome(0, evaluated=False, skipped=[4]), [3.0])
    assert records.metrics.rows == []  # no row on a round without evaluation
    records.record(_outcome(1, evaluated=True, skipped=[5, 2]), [3.0, 5.0])
    (row,) = records.metrics.rows
    assert row["round"] == 2
    assert row["test_acc"] == 4 / 10  # (3 + 1) / (4 + 6), pooled
    assert row["test_acc_head"] == 6 / 10
    assert row["test_acc_std"] == pytest.approx(math.sqrt(((3 / 4 - 11 / 24) ** 2 + (1 / 6 - 11 / 24) ** 2) / 2))
    assert row["train_loss"] == (2.0 + 6.0) / 40
    assert row["test_acc_worst10"] == 1 / 6  # the worst 10 % of 2 clients: one, client 1
    assert row["test_auc"] == 0.75  # client 1's AUC is undefined: client 0's alone, weighted by its samples
    assert row["skipped_clients"] == [4, 5, 2]  # round 1's skip is not lost for want of a row
    assert row["bytes_setup_up"] == 7
    assert row["bytes_theory_up"] == 400  # the ranks' own counts, summed
    assert (row["bytes_up"], row["bytes_down"]) == (40, 60)
    assert (row["seconds"], row["client_s"], row["server_s"]) == (5.0, 2.0, 0.25)
    assert row["comm_s"] == 5.0 - 2.0 - 0.25
    assert row["rank_idle_share"] == pytest.approx([0.0, 0.5])  # client ranks 1 and 2: 2.0 s and 1.0 s
    assert row["margin"] == 1.5
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [row]
    records.record(_outcome(2, evaluated=True, skipped=[]), [3.0, 5.0, 4.0])
    last = records.metrics.rows[-1]
    assert last["skipped_clients"] == [] and "bytes_setup_up" not in last  # both reported once
    assert "round 3/3" in capsys.readouterr().out


def test_the_summary_names_the_run(records, tmp_path):
    records.record(_outcome(1, evaluated=True, skipped=[]), [5.0])
    summary = records.finish([4.0, 6.0], {"world_size": 3}, {"generator": "g"}, None)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["seconds_per_round"] == 5.0 and summary["world_size"] == 3 and summary["generator"] == "g"
    assert summary["config_hash"] == records.config.config_hash()
    assert (tmp_path / "config.yaml").exists()


def test_the_stop_decision_counts_diverged_rounds_in_a_row():
    decide = StopDecision(max_diverged_rounds=2).decide
    nan = _outcome(0, False, [], losses=(math.nan, math.inf)).reports
    half = _outcome(0, False, [], losses=(math.nan, 3.0)).reports
    assert decide(nan) == DIVERGING
    assert decide(half) == 0  # one finite loss: the run is not diverging, the count starts over
    assert decide(nan) == DIVERGING
    assert decide(nan) == DIVERGING | GIVE_UP
    stopping = RoundReports(half.clients, [RankReport(0.0, 0.0, 0.0), RankReport(0.0, 0.0, 1.0)])
    assert decide(stopping) == STOP
    assert StopDecision(0).decide(nan) == DIVERGING  # 0: never give up


def test_per_client_row_holds_every_tested_clients_own_figures():
    row = per_client_row(_outcome(1, evaluated=True, skipped=[]))
    assert row == {"round": 2, "clients": [0, 1], "test_acc": [3 / 4, 1 / 6], "test_acc_head": [1 / 4, 5 / 6],
                   "test_samples": [4, 6], "test_auc": [0.75, None]}


def test_the_run_auc_weights_each_client_by_its_test_samples():
    import numpy as np

    # (0.5·1 + 1.0·3) / 4 (HtFLlib's weighting; the plain mean would be 0.75); undefined ones left out
    assert pooled_auc(np.array([0.5, 1.0, np.nan]), np.array([1.0, 3.0, 5.0])) == 0.875
    assert pooled_auc(np.array([np.nan]), np.array([2.0])) is None
