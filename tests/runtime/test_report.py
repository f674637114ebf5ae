"""Run reports: reading run directories back (finished or running), summaries, CSV, plots, the CLI.

Synthetic run directories laid out as ``htfl_dist.main`` writes them; no training here.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from htfl_dist.metrics.report import (
    MetricsFileError,
    ReportError,
    plot_curves,
    read_run,
    report_table,
    rounds_csv,
    run_labels,
    summarise,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _config(rounds: int, algorithm: str = "fedproto") -> dict:
    """The shape of the config.yaml the real program writes (the resolved config, abridged)."""
    return {
        "algorithm": algorithm, "rounds": rounds, "seed": 3, "num_clients": 6, "join_ratio": 1.0, "eval_every": 1,
        "data": {"dataset": "fmnist", "root": None, "partition": "dirichlet", "beta": 0.1, "subsample": 0.02},
        "model": {"group": "HtCNN8", "feature_dim": 512},
        "train": {"batch_size": 10, "lr": 0.01, "local_epochs": 1},
        "runtime": {"backend": "auto", "device": "auto", "threads": 1},
        "algo": {},
    }


def _row(round_number: int, acc: float, head: float, seconds: float, server_s: float, up: int, theory_up: int,
         **extra) -> dict:
    return {"round": round_number, "test_acc": acc, "test_acc_head": head, "test_acc_std": 0.1, "train_loss": 1.5,
            "bytes_up": up, "bytes_down": 2000, "bytes_theory_up": theory_up, "bytes_theory_down": 4000,
            "seconds": seconds, "client_s": seconds - server_s, "server_s": server_s, "comm_s": 0.0,
            "skipped_clients": [], **extra}


ROWS = [  # best 0.8 first reached in round 2; means: 3.0 s, 0.5 s server, 1100 bytes up; max up/theory 1.2
    _row(1, 0.5, 0.6, 2.0, 0.5, 1000, 900),
    _row(2, 0.8, 0.7, 4.0, 1.0, 1100, 1000),
    _row(3, 0.8, 0.75, 3.0, 0.0, 1200, 1000),
]


def _write_run(directory: Path, rows: list[dict], rounds: int | None = None, algorithm: str = "fedproto",
               tail: str = "") -> Path:
    """A run directory; finished (summary.json) when it holds all ``rounds``; ``tail`` is raw text
    appended to metrics.jsonl (a line being written)."""
    rounds = rounds or len(rows)
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(_config(rounds, algorithm), sort_keys=False))
    lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    (directory / "metrics.jsonl").write_text(lines + tail)
    if len(rows) == rounds:
        summary = {"best_test_acc": 0.8, "best_round": 2, "last_test_acc": rows[-1]["test_acc"], "rounds": rounds,
                   "world_size": 1, "transport": "local", "device": "cpu"}
        (directory / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return directory


def _fedtgp_run(directory: Path) -> Path:
    rows = [_row(r, 0.4 + 0.1 * r, 0.5, 1.0, 0.2, 1000, 1000, margin=2.0 * r, server_loss=4.0 - r,
                 class_margin_global=[1.5, 2.5]) for r in (1, 2)]
    return _write_run(directory, rows, algorithm="fedtgp")


def test_summary_matches_hand_computed_numbers(tmp_path):
    s = summarise(read_run(_write_run(tmp_path / "fedproto-a", ROWS)))
    assert (s["run"], s["algorithm"], s["dataset"], s["partition"], s["model_group"], s["seed"]) == (
        "fedproto-a", "fedproto", "fmnist", "dirichlet", "HtCNN8", 3)
    assert (s["rounds_done"], s["rounds_planned"], s["finished"]) == (3, 3, True)
    assert (s["best_test_acc"], s["best_round"], s["last_test_acc"], s["last_test_acc_head"]) == (0.8, 2, 0.8, 0.75)
    assert s["best_test_acc_head"] == 0.75
    assert s["seconds_per_round"] == pytest.approx(3.0)
    assert s["server_s"] == pytest.approx(0.5)
    assert s["server_share"] == pytest.approx(0.5 / 3.0)
    assert s["bytes_up_per_round"] == pytest.approx(1100)
    assert s["max_bytes_up_over_theory"] == pytest.approx(1.2)


def test_table_row(tmp_path):
    table = report_table([read_run(_write_run(tmp_path / "fedproto-a", ROWS))])
    header, separator, row = table.splitlines()
    assert header.startswith("| run | algorithm |") and separator.startswith("|---|")
    assert row == ("| fedproto-a | fedproto | fmnist | dirichlet | HtCNN8 | 3 | 3/3 | 80.00 (2) | 80.00 | 75.00 "
                   "| 3.00 | 0.500 (16.7 %) | 0.001 | 1.2000 |")


def test_running_job_with_half_written_last_line(tmp_path):
    run = read_run(_write_run(tmp_path / "running", ROWS[:2], rounds=5, tail='{"bytes_down": 20, "round": 3, "tes'))
    assert run.summary is None
    assert [row["round"] for row in run.rows] == [1, 2]
    s = summarise(run)
    assert (s["rounds_done"], s["rounds_planned"], s["finished"], s["last_test_acc"]) == (2, 5, False, 0.8)
    assert "| 2/5 |" in report_table([run])


def test_resumed_run_with_raised_rounds_is_unfinished(tmp_path):
    """--resume auto rounds=MORE leaves the first end's summary.json until the run ends again."""
    directory = _write_run(tmp_path / "resumed", ROWS[:2])
    _write_run(tmp_path / "longer", ROWS, rounds=5)
    for name in ("config.yaml", "metrics.jsonl"):
        (directory / name).write_text((tmp_path / "longer" / name).read_text())
    run = read_run(directory)
    assert run.summary is None
    assert (summarise(run)["rounds_done"], summarise(run)["finished"]) == (3, False)


def test_run_with_no_evaluated_round_yet(tmp_path):
    run = read_run(_write_run(tmp_path / "fresh", [], rounds=5))
    s = summarise(run)
    assert (s["rounds_done"], s["best_test_acc"], s["seconds_per_round"]) == (0, None, None)
    assert "| 0/5 | - (-) |" in report_table([run])


def test_damaged_middle_line_is_an_error_naming_file_and_line(tmp_path):
    directory = _write_run(tmp_path / "damaged", ROWS)
    lines = (directory / "metrics.jsonl").read_text().splitlines(keepends=True)
    (directory / "metrics.jsonl").write_text(lines[0] + '{"round": 2, "test_' + "\n" + lines[2])
    with pytest.raises(MetricsFileError, match=r"damaged/metrics\.jsonl, line 2: not a metrics row") as error:
        read_run(directory)
    assert "\n" not in str(error.value)


def test_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for path, reason in ((tmp_path / "empty", "has neither metrics.jsonl nor config.yaml"),
                         (tmp_path / "missing", "does not exist")):
        with pytest.raises(ReportError, match="is not a run directory") as error:
            read_run(path)
        assert str(path) in str(error.value) and reason in str(error.value)
        assert "config.yaml" in str(error.value)  # says what a run directory holds


@pytest.mark.parametrize("text,reason", [
    ("algorithm: fedproto\nrounds: [3\n", "invalid YAML, line 3"),  # cut off mid-write
    ("- fedproto\n- 3\n", "a YAML list, not a mapping"),
])
def test_damaged_config_is_a_one_line_error(tmp_path, text, reason):
    directory = _write_run(tmp_path / "run", ROWS)
    (directory / "config.yaml").write_text(text)
    with pytest.raises(ReportError, match="not a run config") as error:
        read_run(directory)
    message = str(error.value)
    assert str(directory / "config.yaml") in message and reason in message and "\n" not in message


def test_csv_holds_every_run_s_rows_under_one_header(tmp_path):
    runs = [read_run(_write_run(tmp_path / "proto", ROWS)), read_run(_fedtgp_run(tmp_path / "tgp"))]
    table = list(csv.reader(rounds_csv(runs).splitlines()))
    header, rows = table[0], table[1:]
    assert header[:4] == ["run", "round", "test_acc", "test_acc_head"]
    assert header[header.index("comm_s") + 1:] == ["class_margin_global", "margin", "server_loss", "skipped_clients"]
    assert [(row[0], row[1]) for row in rows] == [("proto", "1"), ("proto", "2"), ("proto", "3"),
                                                  ("tgp", "1"), ("tgp", "2")]
    record = dict(zip(header, rows[3], strict=True))
    assert json.loads(record["class_margin_global"]) == [1.5, 2.5]
    assert (record["margin"], record["skipped_clients"]) == ("2.0", "[]")
    assert dict(zip(header, rows[0], strict=True))["margin"] == ""  # FedProto logs no margin


def test_plot_is_a_png(tmp_path):
    runs = [read_run(_write_run(tmp_path / "proto", ROWS)), read_run(_fedtgp_run(tmp_path / "tgp"))]
    for metric in ("test_acc", "margin"):
        out = tmp_path / "plots" / f"{metric}.png"
        plot_curves(runs, metric, out=out)
        data = out.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert sorted(path.name for path in (tmp_path / "plots").iterdir()) == ["margin.png", "test_acc.png"]  # no temps


def test_unknown_metric_lists_the_numeric_keys(tmp_path):
    runs = [read_run(_fedtgp_run(tmp_path / "tgp"))]
    with pytest.raises(ReportError, match="unknown metric 'margn'") as error:
        plot_curves(runs, "margn", out=tmp_path / "x.png")
    message = str(error.value)
    assert "margin" in message and "server_loss" in message and "test_acc" in message
    assert "class_margin_global" not in message and "skipped_clients" not in message  # lists are not numbers
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    with pytest.raises(ReportError, match="pip install matplotlib"):
        plot_curves([read_run(_write_run(tmp_path / "proto", ROWS))], out=tmp_path / "x.png")


def test_labels_tell_apart_runs_with_the_same_directory_name(tmp_path):
    runs = [read_run(_write_run(tmp_path / parent / "fedproto", ROWS)) for parent in ("a", "b")]
    assert run_labels(runs) == ["a/fedproto", "b/fedproto"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "htfl_dist.report", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.launch
def test_cli_prints_the_table_and_writes_csv(tmp_path):
    proto, tgp = _write_run(tmp_path / "proto", ROWS), _fedtgp_run(tmp_path / "tgp")
    result = _cli(str(proto), str(tgp), "--metric", "margin", "--csv", str(tmp_path / "rounds.csv"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| run |") and lines[0].endswith("| last margin |")
    assert lines[2].startswith("| proto | fedproto |") and lines[2].endswith("| - |")
    assert lines[3].startswith("| tgp | fedtgp |") and lines[3].endswith("| 4 |")
    assert len((tmp_path / "rounds.csv").read_text().splitlines()) == 1 + 5


@pytest.mark.launch
@pytest.mark.parametrize("args,needles", [
    (["{tmp}/nowhere"], ["{tmp}/nowhere is not a run directory", "metrics.jsonl"]),
    (["{run}", "--metric", "margin"], ["unknown metric 'margin'", "test_acc"]),
    (["{run}", "--time-to", "0"], ["--time-to takes accuracies in percent", "got 0"]),
    (["{run}", "--time-to", "60", "--x", "sim_clock_s"], ["unknown metric 'sim_clock_s'"]),
])
def test_cli_user_errors_are_one_line_and_exit_code_2(tmp_path, args, needles):
    run = _write_run(tmp_path / "proto", ROWS)
    result = _cli(*(arg.format(tmp=tmp_path, run=run) for arg in args))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("htfl_dist: error: "), result.stderr
    for needle in needles:
        assert needle.format(tmp=tmp_path) in lines[0]


def test_time_to_accuracy_is_the_first_crossing_on_the_chosen_axis(tmp_path):
    """Sync against async on one simulated clock: the x of the first row at or above each target,
    "-" for a target never reached; a dip after the crossing does not move it."""
    rows = [_row(1, 0.50, 0.6, 2.0, 0.5, 1000, 900, sim_clock_s=0.5),
            _row(2, 0.62, 0.7, 4.0, 1.0, 1100, 1000, sim_clock_s=1.25),
            _row(3, 0.55, 0.7, 3.0, 0.0, 1200, 1000, sim_clock_s=2.0),
            _row(4, 0.70, 0.7, 3.0, 0.0, 1200, 1000, sim_clock_s=3.5)]
    run = read_run(_write_run(tmp_path / "async", rows))
    header, _, row = report_table([run], time_to=(50, 60, 70, 90), x="sim_clock_s").splitlines()
    assert header.endswith("| sim_clock_s to 50 % | sim_clock_s to 60 % | sim_clock_s to 70 % | sim_clock_s to 90 % |")
    assert row.endswith("| 0.5 | 1.25 | 3.5 | - |")
    header, _, row = report_table([run], time_to=(60,)).splitlines()
    assert header.endswith("| round to 60 % |") and row.endswith("| 2 |")


def test_a_started_run_without_rows_is_listed(tmp_path):
    """A run that has written config.yaml but not evaluated its first round yet is reported with
    no numbers instead of failing the whole report (e.g. `report runs/*` during a sweep)."""
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.yaml").write_text(yaml.safe_dump(_config(5, "fedproto"), sort_keys=False))
    record = read_run(started)
    assert record.rows == [] and record.summary is None
    summary = summarise(record)
    assert summary["best_test_acc"] is None and summary["finished"] is False
    assert "started" in report_table([record])
