"""The round loop's records and stop decision, by hand: rank 0 turns hand-made round outcomes into
rows (no transport, no models), and decides at each round boundary from hand-made reports."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import SMOKE
from htfl_dist.config import load_config
from htfl_dist.errors import EXIT_FAILURE, NothingAggregated
from htfl_dist.runtime.exchange import (
    DIVERGING,
    GIVE_UP,
    STOP,
    RankReport,
    RoundReports,
    RoundTraffic,
    StopDecision,
)
from htfl_dist.runtime.records import (
    RoundOutcome,
    RoundRecords,
    class_weighted_columns,
    per_client_row,
    pooled_auc,
)


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


def _lost(round_index: int, evaluated: bool = True, dropped=(0, 1), late=(), arrived=0) -> RoundOutcome:
    """A round whose server step was skipped (the loop's diagnostics) after the participation
    policy kept ``arrived`` of the two uploads."""
    outcome = _outcome(round_index, evaluated, skipped=[])
    outcome.diagnostics = {"server_skipped": True}
    outcome.participation = {"dropped_clients": list(dropped), "late_clients": list(late), "arrived_clients": arrived}
    return outcome


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _records(tmp_path, *overrides: str) -> RoundRecords:
    records = RoundRecords(load_config(SMOKE, ["rounds=3", *overrides]), tmp_path, world_size=3)
    records.begin(1)
    return records


def test_a_round_that_aggregated_nothing_says_so_in_one_line(tmp_path, capsys):
    """participation.drop_rate=0.99 dropped every upload and said nothing (the audit)."""
    records = _records(tmp_path, "participation.drop_rate=0.99", "participation.clock=true",
                       "participation.deadline_s=10")
    records.record(_lost(0, evaluated=False), [1.0])
    records.record(_lost(1, dropped=[0], late=[1]), [1.0, 1.0])
    records.record(_outcome(2, evaluated=True, skipped=[]), [1.0, 1.0, 1.0])  # aggregated: no line
    assert _warnings(capsys) == [
        "htfl_dist: warning: round 1: the server aggregated nothing (0 of 2 uploads arrived; 2 dropped "
        "(participation.drop_rate=0.99)); it keeps last round's knowledge",
        "htfl_dist: warning: round 2: the server aggregated nothing (0 of 2 uploads arrived; 1 dropped "
        "(participation.drop_rate=0.99); 1 late (participation.deadline_s=10)); it keeps last round's knowledge"]
    records.finish([1.0] * 3, {}, {}, None)  # one round aggregated: the run has a result
    assert _warnings(capsys) == []


def test_too_few_arrivals_and_bad_uploads_are_said_once_by_the_round_loop(tmp_path, capsys):
    """Below participation.min_clients, or with every upload left out as bad, the round loop says
    why in its own line (tests/e2e/test_bad_inputs.py's diverged run shows the latter): not a
    second one."""
    records = _records(tmp_path, "participation.min_clients=2")
    records.record(_lost(0, dropped=[0], arrived=1), [1.0])
    bad = _lost(1, dropped=[], arrived=2)
    bad.skipped = [0, 1]
    records.record(bad, [1.0, 1.0])
    assert _warnings(capsys) == []


def test_a_run_in_which_no_round_aggregated_ends_in_one_line(tmp_path, capsys):
    records = _records(tmp_path, "participation.drop_rate=0.99")
    for round_index in range(3):
        records.record(_lost(round_index), [1.0] * (round_index + 1))
    assert len(_warnings(capsys)) == 3
    with pytest.raises(NothingAggregated) as ended:
        records.finish([1.0] * 3, {}, {}, None)
    assert ended.value.exit_status == EXIT_FAILURE != 0
    assert str(ended.value).startswith("no round of this run aggregated an upload (3 played, each said above with why)")
    assert "participation.drop_rate (now 0.99)" in str(ended.value) and "\n" not in str(ended.value)
    assert (tmp_path / "summary.json").exists()  # what the run did is on record all the same


def test_a_resumed_run_whose_earlier_part_aggregated_ends_as_usual(tmp_path, capsys):
    """Rounds 1-2 ran before the resume, round 1 aggregated (its row has no server_skipped): the
    run has a result though nothing after the resume aggregated."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_acc": 0.5}) + "\n"
                                            + json.dumps({"round": 2, "server_skipped": True}) + "\n")
    records = RoundRecords(load_config(SMOKE, ["rounds=3"]), tmp_path, world_size=3)
    records.metrics.load_existing(2)
    records.begin(3)
    records.record(_lost(2), [1.0])
    records.finish([1.0], {}, {}, None)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "server_skipped": True}) + "\n")
    records = RoundRecords(load_config(SMOKE, ["rounds=3"]), tmp_path, world_size=3)
    records.metrics.load_existing(1)
    records.begin(2)
    records.record(_lost(1), [1.0])
    with pytest.raises(NothingAggregated):
        records.finish([1.0], {}, {}, None)


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


def test_fednh_weightings_are_a_plain_mean_over_clients_without_the_undefined():
    # rows: correct, by the head, samples, AUC, validclass, labeldist
    reports = {2: _client(None, [1.0, 1.0, 10.0, 0.5, 0.2, 0.3]), 0: _client(None, [9.0, 9.0, 10.0, 0.9, 0.8, 0.6]),
               5: _client(None, [5.0, 5.0, 10.0, 0.1, float("nan"), 0.9]), 7: _client([1.0, 2.0], None)}
    assert class_weighted_columns(reports, "test", per_client=False) == {
        "test_acc_validclass": pytest.approx((0.8 + 0.2) / 2),
        "test_acc_labeldist": pytest.approx((0.6 + 0.3 + 0.9) / 3)}
    assert class_weighted_columns(reports, "test", per_client=True) == {
        "test_acc_validclass": [0.8, 0.2, None], "test_acc_labeldist": [0.6, 0.3, 0.9]}
