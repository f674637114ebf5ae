"""MLflow and Weights & Biases copies of a run, read back through the libraries' own readers: the
metrics equal metrics.jsonl, a resume continues the same tracking run, a study's cells sit in one
experiment, a missing package is one line before anything starts, and a tracker that fails mid-run
costs its copy, not the run."""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient  # both in the test extra: CI has them

from conftest import SMOKE, TIMING_KEYS, read_metrics, run_program
from htfl_dist.metrics.sinks import row_numbers
from htfl_dist.metrics.tracking import TRACKING_FILE, flat_params

pytestmark = pytest.mark.integration


def _smoke(out: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
            "runtime.placement_work=samples", *extra]


def _client(uri: Path) -> MlflowClient:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri.resolve().as_uri())


def _histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in run.data.metrics}


def _expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row_numbers(row).items():
            expected.setdefault(key, []).append((row["round"], value))
    return expected


# ------------------------------------------------------------------------- a run killed, then resumed


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, cache_dir):
    """Rounds 1-2 with a checkpoint each, MLflow and W&B on; then round 2's checkpoint is lost (as
    when a run is killed after round 2's row, before its checkpoint), and ``--resume auto``
    continues from round 1 to round 3."""
    out = tmp_path_factory.mktemp("tracked")
    common = _smoke(out, cache_dir, "output.mlflow=true", "output.wandb=true", "checkpoint_every=1")
    first = run_program([*common, "rounds=2"])
    assert first.returncode == 0, first.stdout + first.stderr
    ids_after_first = json.loads((out / TRACKING_FILE).read_text())
    shutil.rmtree(out / "checkpoints" / "round_00002")
    resumed = run_program([*common, "rounds=3", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resume: continuing after round 1" in resumed.stdout
    assert "warning" not in first.stderr + resumed.stderr, first.stderr + resumed.stderr
    return out, ids_after_first


def test_mlflow_holds_one_run_whose_metrics_equal_metrics_jsonl(killed_and_resumed):
    out, ids_after_first = killed_and_resumed
    client = _client(out / "mlruns")
    experiment = client.get_experiment_by_name("htfl_dist")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resume continued the first attempt's tracking run
    run = runs[0]
    assert run.info.run_id == ids_after_first["mlflow"]["run_id"]
    assert run.info.status == "FINISHED" and run.info.run_name == out.name
    rows = read_metrics(out)
    assert [row["round"] for row in rows] == [1, 2, 3]
    # every number of every row at step = round, each round once: round 2, logged by the killed
    # attempt and computed again after the resume, is not logged twice; its maths are the same
    # (the run is deterministic), its wall times those of the first computation
    histories = _histories(client, run.info.run_id)
    expected = _expected(rows)
    assert set(histories) == set(expected)
    for key, points in histories.items():
        assert [step for step, _ in points] == [step for step, _ in expected[key]], key
        kept = points if key not in TIMING_KEYS else [p for p in points if p[0] != 2]
        assert kept == [p for p in expected[key] if key not in TIMING_KEYS or p[0] != 2], key
    summary = json.loads((out / "summary.json").read_text())
    assert run.data.tags["htfl_dist.config_hash"] == summary["config_hash"]
    assert run.data.tags["htfl_dist.code_version"].startswith("0.1.0")
    params = run.data.params
    assert params["data.dataset"] == "fmnist" and params["algorithm"] == "fedproto"
    assert params["model.group"] == "HtCNN8" and params["output.mlflow"] == "true"
    assert params["rounds"] == "2"  # an MLflow param cannot change: the first attempt's value stays
    artifacts = {entry.path for entry in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "per_client.jsonl", "config.yaml"} <= artifacts


def _wandb_records(path: Path):
    """The records of a W&B transaction log (``run-ID.wandb``): LevelDB's log format (32 KiB
    blocks of chunks with a 7-byte header: CRC, length, type full/first/middle/last) after W&B's
    own 7-byte header, each record a ``wandb_internal_pb2.Record``. wandb 0.31 ships no Python
    reader of its own (its core, written in Go, reads them), hence these lines."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += left  # the block's zero padding
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_run_holds_the_rows_under_one_id(killed_and_resumed):
    out, ids_after_first = killed_and_resumed
    run_id = ids_after_first["wandb"]["run_id"]
    attempts = sorted((out / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(a.name.endswith(f"-{run_id}") for a in attempts)  # one run, two attempts
    history: dict[int, dict[str, float]] = {}
    for attempt in attempts:
        for record in _wandb_records(attempt / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id and record.run.project == "htfl_dist"
                assert record.run.display_name == out.name
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
                assert config["data"]["dataset"] == "fmnist" and config["seed"] == 0
                summary = json.loads((out / "summary.json").read_text())
                assert config["htfl_dist"]["config_hash"] == summary["config_hash"]
                assert record.run.tags[0].startswith("config_hash=")
            elif kind == "history":
                values = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                history[record.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
    rows = read_metrics(out)
    assert history == {row["round"]: row_numbers(row) for row in rows}  # the resume's round 2 replaces the first
    assert (attempts[-1] / "files" / "summary.json").read_bytes() == (out / "summary.json").read_bytes()


def test_params_are_the_config_flattened():
    assert flat_params({"a": 1, "b": {"c": "x", "d": [1, 2], "e": None}, "f": {}}) == \
        {"a": "1", "b.c": "x", "b.d": "[1, 2]", "b.e": "null", "f": "{}"}


# ------------------------------------------------------------------------------------ a study's cells


def test_a_studys_cells_are_one_experiment_in_one_store(tmp_path, cache_dir):
    """The study's cells (two seeds) as its scheduler starts them, played in this process: one
    MLflow experiment named after the study in DIR/mlruns, a run per cell named after it."""
    from htfl_dist.study import plan

    study_file = tmp_path / "study.yaml"
    study_file.write_text(f"title: tiny grid\nbase: {SMOKE}\nseeds: [0, 1]\n"
                          f"set: {{rounds: 1, output.mlflow: true, data.cache_dir: {cache_dir}}}\n")
    out = tmp_path / "out"
    study = plan.validate(plan.expand(study_file))
    for cell in study.cells:
        result = run_program(cell.main_args(out))
        assert result.returncode == 0, result.stdout + result.stderr
    client = _client(out / "mlruns")
    experiment = client.get_experiment_by_name("tiny grid")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(run.info.run_name for run in runs) == ["smoke-seed0", "smoke-seed1"]
    assert {run.data.tags["htfl_dist.group"] for run in runs} == {"tiny grid"}
    assert sorted(run.data.params["seed"] for run in runs) == ["0", "1"]
    for run in runs:
        rows = read_metrics(plan.Cell("smoke", int(run.data.params["seed"]), SMOKE, ()).run_dir(out))
        assert _histories(client, run.info.run_id) == _expected(rows)
    # a study without a tracker passes no grouping: its cells' commands stay as they were
    untracked = plan.validate(plan.expand(study_file, extra=["output.mlflow=false"]))
    assert not any("tracking" in arg for arg in untracked.cells[0].main_args(out))


# ------------------------------------------------------------------------------------- missing, failing


@pytest.mark.parametrize(("key", "package"), [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_missing_tracker_is_one_line_before_anything_starts(tmp_path, cache_dir, monkeypatch, key, package):
    """A Python without the package (simulated: its import refused, ``sys.modules[name] = None``)
    gets exit 2 and the install hint before the run directory is made."""
    monkeypatch.setitem(sys.modules, key, None)
    result = run_program(_smoke(tmp_path / "run", cache_dir, f"output.{key}=true"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (f"htfl_dist: error: output.{key}=true needs the {package} package: "
                                     f"pip install -e .[{key}] (or pip install {package})")
    assert not (tmp_path / "run").exists()


def test_a_tracker_failing_mid_run_costs_its_copy_not_the_run(tmp_path, cache_dir):
    """The MLflow store is taken away once round 1's row is written (as a server that loses the
    run, or a disk that goes): one warning line, and the run writes every row and its summary."""
    out, store = tmp_path / "run", tmp_path / "store"
    gone = threading.Event()

    def take_the_store_away() -> None:
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            time.sleep(0.005)
        store.rename(tmp_path / "taken")  # at once: an rmtree races the writer adding a file under it
        gone.set()
        shutil.rmtree(tmp_path / "taken")

    thief = threading.Thread(target=take_the_store_away, daemon=True)
    thief.start()
    result = run_program(_smoke(out, cache_dir, "rounds=4", "output.mlflow=true", f"output.mlflow_uri={store}"))
    thief.join(timeout=10)
    assert gone.is_set()
    assert result.returncode == 0, result.stdout + result.stderr
    assert [row["round"] for row in read_metrics(out)] == [1, 2, 3, 4]
    assert (out / "summary.json").is_file()
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith("htfl_dist: warning: the mlflow copy of the metrics stopped at round ")
    assert warnings[0].endswith("metrics.jsonl keeps every row and the run goes on without it")


# ------------------------------------------------------------------------------- report --follow


def _play_run(run_dir: Path, rows: int, every_s: float, summary: bool = True) -> threading.Thread:
    """A run being written by someone else: config.yaml, then a row every ``every_s`` (the last
    one cut in two, as a reader can catch it), then summary.json."""
    from htfl_dist.metrics.writer import write_atomic, write_json

    def play() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", f"algorithm: fedproto\nrounds: {rows}\ndata: {{dataset: fmnist}}\n")
        with open(run_dir / "metrics.jsonl", "a") as metrics:
            for number in range(1, rows + 1):
                time.sleep(every_s)
                line = json.dumps({"round": number, "test_acc": number / 10, "test_acc_head": number / 20,
                                   "seconds": 2.0})
                metrics.write(line[:10])
                metrics.flush()
                time.sleep(every_s / 4)
                metrics.write(line[10:] + "\n")
                metrics.flush()
        if summary:
            time.sleep(every_s)
            write_json(run_dir / "summary.json", {"rounds": rows, "best_test_acc": rows / 10, "best_round": rows,
                                                  "last_test_acc": rows / 10})

    player = threading.Thread(target=play, daemon=True)
    player.start()
    return player


def test_follow_prints_each_round_as_it_arrives_and_ends_with_the_run(tmp_path, capsys):
    from htfl_dist.report import main as report_main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    player = _play_run(run_dir, rows=4, every_s=0.08)
    assert report_main(["--follow", str(run_dir), "--interval", "0.01"]) == 0
    player.join()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"following {run_dir}: fedproto on fmnist, 4 rounds (Ctrl-C stops following, not the run)"
    assert lines[1:5] == ["round 1/4  acc  10.00%  head   5.00%    2.00s  ETA 0:00:06",
                          "round 2/4  acc  20.00%  head  10.00%    2.00s  ETA 0:00:04",
                          "round 3/4  acc  30.00%  head  15.00%    2.00s  ETA 0:00:02",
                          "round 4/4  acc  40.00%  head  20.00%    2.00s  ETA 0:00:00"]
    assert lines[5:] == ["finished: best acc 40.00% (round 4), last 40.00%"]


def test_follow_shows_a_studys_cells_with_their_state_until_all_have_ended(tmp_path, capsys):
    from htfl_dist.metrics.writer import write_json
    from htfl_dist.report import main as report_main

    study = tmp_path / "study"
    write_json(study / "study.json", {"study": "s.yaml", "cells": {"a-seed0": "h", "b-seed0": "h", "c-seed0": "h"}})
    first = _play_run(study / "cells" / "a-seed0", rows=2, every_s=0.05)
    first.join()
    failed = study / "cells" / "c-seed0"
    _play_run(failed, rows=1, every_s=0.0, summary=False).join()
    (failed / "output.log").write_text("study: python -m htfl_dist.main\nhtfl_dist: error: the data are gone\n")
    second = _play_run(study / "cells" / "b-seed0", rows=3, every_s=0.15)
    assert report_main(["--follow", str(study), "--interval", "0.01"]) == 0
    second.join()
    views = capsys.readouterr().out.split(f"study {study}: ")[1:]
    assert views[-1].splitlines() == ["2 finished, 1 failed",
                                      "| cell | state | rounds | last acc % | ETA |",
                                      "|---|---|---|---|---|",
                                      "| a-seed0 | finished | 2/2 | 20.00 |  |",
                                      "| b-seed0 | finished | 3/3 | 30.00 |  |",
                                      "| c-seed0 | failed | 1/1 | 10.00 |  |"]
    assert any("| b-seed0 | running | 1/3 | 10.00 | 0:00:04 |" in view for view in views[:-1])
