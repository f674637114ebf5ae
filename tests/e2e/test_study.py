"""Studies (python -m htfl_dist.study): grid expansion and cell keys, per-cell validation, packing,
the table's folding over seeds, the refusal of a foreign directory, a study killed with SIGTERM
or SIGKILL and run again (its cells' metrics equal an uninterrupted study's; a SIGKILLed study's
cells die with it), one study at a time per directory, and each cell's log and failure its own."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SMOKE, _env, maths_only, read_metrics
from htfl_dist.metrics.report import RunRecord
from htfl_dist.resolution import resolved_config
from htfl_dist.study import plan, schedule, table
from htfl_dist.study.__main__ import main as study_main


def write_study(folder: Path, **content) -> Path:
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump({"base": str(SMOKE), **content}))
    return path


# ------------------------------------------------------------------------------------ grid and cells

def test_grid_product_keys_overrides_and_cell_patterns(tmp_path):
    path = write_study(tmp_path, set={"rounds": 2, "train": {"lr": 0.05}},
                       grid={"algorithm": ["fedproto", "fedtgp"], "data.partition": ["dirichlet", "pathological"]},
                       seeds=[3, 4], cells={"fedtgp": {"algo.tau": 50}, "fedtgp/pathological": {"algo.tau": 7}},
                       paper={"fedproto/dirichlet": "97.46 ± 0.01"})
    study = plan.expand(path)
    assert study.keys == ["fedproto/dirichlet", "fedproto/pathological", "fedtgp/dirichlet", "fedtgp/pathological"]
    assert [cell.name for cell in study.cells[:3]] == ["fedproto/dirichlet-seed3", "fedproto/dirichlet-seed4",
                                                        "fedproto/pathological-seed3"]
    assert len(study.cells) == 8 and study.paper == {"fedproto/dirichlet": 97.46}
    by_name = {cell.name: cell for cell in study.cells}
    assert by_name["fedproto/dirichlet-seed3"].overrides == (
        "rounds=2", "train.lr=0.05", "algorithm=fedproto", "data.partition=dirichlet", "seed=3")
    assert by_name["fedtgp/dirichlet-seed4"].overrides[-2:] == ("algo.tau=50", "seed=4")
    assert by_name["fedtgp/pathological-seed4"].overrides[-2:] == ("algo.tau=7", "seed=4")  # the specific one wins
    assert by_name["fedtgp/pathological-seed4"].run_dir(tmp_path) == tmp_path / "cells/fedtgp/pathological-seed4"


def test_a_cell_has_the_config_and_hash_main_gives_the_same_overrides(tmp_path):
    path = write_study(tmp_path, grid={"data.beta": [0.5]}, set={"algo": {"reg_weight": 2.0}, "data.subsample": 0.03})
    study = plan.validate(plan.expand(path))
    (cell,) = study.cells
    assert cell.key == "0.5" and cell.rounds == 3
    expected = resolved_config(str(SMOKE), ["algo.reg_weight=2.0", "data.subsample=0.03", "data.beta=0.5", "seed=0"])
    assert cell.config_hash == expected.config_hash()
    assert resolved_config(str(cell.config_file), list(cell.overrides)).to_dict() == expected.to_dict()


def test_base_with_placeholders_and_a_config_axis(tmp_path):
    path = tmp_path / "t10.yaml"
    path.write_text(yaml.safe_dump({"base": str(REPO / "configs" / "fmnist_htcnn8_{algorithm}_{data.partition}.yaml"),
                                    "grid": {"algorithm": ["fedproto", "fml"], "data.partition": ["pathological"]}}))
    cells = plan.expand(path).cells
    assert [c.config_file.name for c in cells] == ["fmnist_htcnn8_fedproto_pathological.yaml",
                                                  "fmnist_htcnn8_fml_pathological.yaml"]
    path.write_text(yaml.safe_dump({"grid": {"config": [os.path.relpath(SMOKE, tmp_path)]}}))  # from the study
    (cell,) = plan.expand(path).cells
    assert cell.key == "smoke" and cell.config_file == SMOKE


@pytest.mark.parametrize("content, message", [
    ({"grid": {"algorithm": "fedproto"}}, "study key 'grid.algorithm' must be a non-empty list"),
    ({"cells": {"fedtgp": {"algo.tau": 1}}}, "study key 'cells.fedtgp' matches no cell"),
    ({"paper": {"fedtgp/dirichlet": 97.0}}, "study key 'paper.fedtgp/dirichlet' names no cell"),
    ({"sets": {}}, "unknown study key 'sets'"),
    ({"seeds": [0, 0]}, "study key 'seeds' must be a list of distinct integers"),
])
def test_study_file_mistakes_are_one_line(tmp_path, content, message):
    with pytest.raises(plan.StudyError, match=message):
        plan.expand(write_study(tmp_path, **content))


def test_a_bad_cell_stops_the_study_before_any_starts_with_one_line(tmp_path, capsys):
    path = write_study(tmp_path, grid={"algorithm": ["fedproto", "fedtgp"]}, seeds=[0, 1],
                       cells={"fedtgp": {"algo.tau": -1}})
    out = tmp_path / "out"
    assert study_main([str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("htfl_dist.study: error: cell fedtgp-seed0: ")
    assert "algo.tau" in err
    assert not out.exists()
    path = write_study(tmp_path, grid={"train.batch_size": [10, 0]})
    assert study_main([str(path), "--out", str(out), "--dry-run"]) == 2
    assert "cell 0-seed0: config key 'train.batch_size' must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (["--jobs", "0"], "--jobs must be >= 1, got 0 (leave --jobs out for the default)"),
    (["--cores", "0"], "--cores must be >= 1, got 0"),
    (["--jobs", "-1"], "--jobs must be >= 1, got -1"),
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--bogus"], "unrecognized arguments: --bogus (python -m htfl_dist.study --help lists the options)"),
])
def test_a_study_command_line_mistake_is_one_line_before_anything_is_written(tmp_path, capsys, arguments, message):
    path = write_study(tmp_path, grid={"algorithm": ["fedproto"]})
    out = tmp_path / "out"
    assert study_main([str(path), "--out", str(out), *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"htfl_dist.study: error: {message}"), err
    assert not out.exists()


@pytest.mark.parametrize("text, message", [
    ("title: a\ntitle: b\nbase: ../c.yaml\n", "key 'title' appears twice in one mapping, at lines 1 and 2"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", "its aliases expand to more than"),
    (b"title: \xff\n", "is not UTF-8 text"),
])
def test_a_study_file_is_read_by_the_bounded_loader(tmp_path, capsys, text, message):
    """A key given twice, an alias bomb (five levels of tenfold aliases: 10^5 values from a few
    hundred bytes) and bytes that are not UTF-8 are refused in one line, as in a config file."""
    path = tmp_path / "study.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert study_main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_dry_run_prints_each_cell_command(tmp_path, capsys):
    path = write_study(tmp_path, grid={"algorithm": ["fedproto", "local"]})
    assert study_main([str(path), "--out", str(tmp_path / "out"), "--dry-run", "--ranks", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fedproto-seed0 [") and "torchrun --standalone --nproc_per_node=3" in lines[0]
    assert lines[1].endswith(f"--out {tmp_path}/out/cells/local-seed0 --resume auto algorithm=local seed=0")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the directory

def test_a_directory_of_another_study_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    first = plan.validate(plan.expand(write_study(tmp_path, grid={"algorithm": ["fedproto", "local"]})))
    plan.claim_directory(out, first)
    plan.claim_directory(out, first)  # the same study again: its own directory
    more_seeds = plan.validate(plan.expand(write_study(tmp_path, grid={"algorithm": ["fedproto", "local"]},
                                                       seeds=[0, 1])))
    plan.claim_directory(out, more_seeds)  # cells added: still this study
    assert set(json.loads((out / "study.json").read_text())["cells"]) == {c.name for c in more_seeds.cells}
    other = write_study(tmp_path, grid={"algorithm": ["fedproto", "local"]}, set={"data.beta": 0.5}, seeds=[0, 1])
    assert study_main([str(other), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds cells of another study (cell fedproto-seed0: config hash" in err and len(err.splitlines()) == 1
    fewer = plan.validate(plan.expand(write_study(tmp_path, grid={"algorithm": ["fedproto"]})))
    with pytest.raises(plan.StudyError, match="cell fedproto-seed1: this study has no such cell"):
        plan.claim_directory(out, fewer)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "metrics.jsonl").write_text("")
    with pytest.raises(plan.StudyError, match=r"not empty and holds no study\.json"):
        plan.claim_directory(stranger, first)


# ------------------------------------------------------------------------------------ packing

def test_cpu_slots_share_the_cores():
    assert schedule.assign_slots(2, 16) == [schedule.Slot((), 8)] * 2
    assert schedule.assign_slots(3, 16, ranks_per_cell=2) == [schedule.Slot((), 2)] * 3  # 16 // 6
    assert schedule.assign_slots(4, 2) == [schedule.Slot((), 1)] * 4  # never below one thread


def test_gpu_slots_pack_k_cells_per_gpu_or_g_gpus_per_cell():
    quarter = schedule.assign_slots(100, 16, gpus=[0, 1], gpus_per_cell=0.25)
    assert [slot.gpus for slot in quarter] == [(0,), (1,)] * 4  # the count limit: 4 per GPU, 8 in all
    assert {slot.threads for slot in quarter} == {2}
    assert [s.gpus for s in schedule.assign_slots(3, 12, gpus=[4, 5, 6], gpus_per_cell=0.5)] == [(4,), (5,), (6,)]
    pairs = schedule.assign_slots(8, 8, ranks_per_cell=2, gpus=[0, 1, 2, 3, 4], gpus_per_cell=2)
    assert [slot.gpus for slot in pairs] == [(0, 1), (2, 3)] and pairs[0].threads == 2
    with pytest.raises(plan.StudyError, match="needs 4 GPUs; 2 visible"):
        schedule.assign_slots(1, 4, gpus=[0, 1], gpus_per_cell=4)
    with pytest.raises(plan.StudyError, match="use 1/k"):
        schedule.assign_slots(1, 4, gpus=[0], gpus_per_cell=0.3)


def test_gpu_slots_packed_by_memory_round_the_devices_and_cap_each_rank():
    """80 and 40 GiB devices, 19.5 GiB a cell and 0.5 GiB of CUDA context a rank: 80 // 20 = 4
    and 40 // 20 = 2 places; with 3 ranks a cell needs 21 GiB (3 and 1 places) and each rank's
    allocator gets a third of 19.5."""
    memory = {0: 80.0, 1: 40.0}
    single = schedule.assign_slots(100, 12, gpus=[0, 1], memory_per_cell_gib=19.5, device_gib=memory)
    assert [slot.gpus for slot in single] == [(0,), (1,), (0,), (1,), (0,), (0,)]
    assert {(slot.memory_gib, slot.threads) for slot in single} == {(19.5, 2)}
    ranked = schedule.assign_slots(100, 12, ranks_per_cell=3, gpus=[0, 1], memory_per_cell_gib=19.5,
                                   device_gib=memory)
    assert [slot.gpus for slot in ranked] == [(0,), (1,), (0,), (0,)] and ranked[0].memory_gib == 6.5
    assert [s.gpus for s in schedule.assign_slots(3, 12, gpus=[1, 0], memory_per_cell_gib=19.5,
                                                  device_gib=memory)] == [(1,), (0,), (1,)]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"gpus": [0, 1], "memory_per_cell_gib": 40.0, "device_gib": {0: 80.0, 1: 40.0}},
     r"GPU 1 has 40.0 GiB, less than one cell needs \(40.5 GiB with 1 CUDA context"),
    ({"gpus": [0], "memory_per_cell_gib": 0.0, "device_gib": {0: 80.0}}, "must be > 0 GiB, got 0"),
    ({"gpus": [0], "gpus_per_cell": 0.5, "memory_per_cell_gib": 8.0, "device_gib": {0: 80.0}},
     "two limits for one thing"),
    ({"memory_per_cell_gib": 8.0}, "no GPU is in use"),
])
def test_packing_by_memory_refuses_what_cannot_fit(kwargs, needle):
    with pytest.raises(plan.StudyError, match=needle):
        schedule.assign_slots(4, 8, **kwargs)


def test_the_command_line_packs_by_memory_and_refuses_it_without_gpus(tmp_path, monkeypatch, capsys):
    """--gpu-memory-per-cell reaches the runner's slots with each device's memory as PyTorch
    reports it (faked: this machine has no GPU); without GPUs it is one line, exit status 2."""
    from htfl_dist.study import __main__ as cli

    path = write_study(tmp_path, grid={"algorithm": ["fedproto", "local"]})
    assert study_main([str(path), "--out", str(tmp_path / "cpu"), "--gpus", "none",
                       "--gpu-memory-per-cell", "8"]) == 2
    assert capsys.readouterr().err.strip() == ("htfl_dist.study: error: --gpu-memory-per-cell packs cells onto GPUs, "
                                               "and no GPU is in use (--gpus)")
    monkeypatch.setattr(cli, "device_memory_gib", lambda gpus: {0: 80.0, 1: 40.0})
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = {}

    class Runner:
        def __init__(self, out, slots, ranks, progress_every_s, all_cells):
            seen["slots"] = slots

        def run(self, pending, already_done):
            return schedule.Outcome(done=list(pending))

        def progress_line(self, waiting):
            return "study: progress"

    monkeypatch.setattr(cli.schedule, "LocalRunner", Runner)
    monkeypatch.setattr(cli.table, "write_outputs", lambda study, out: "study: table")
    assert study_main([str(path), "--out", str(tmp_path / "gpu"), "--gpus", "0,1", "--cores", "12",
                       "--gpu-memory-per-cell", "19.5"]) == 0
    assert [slot.gpus for slot in seen["slots"]] == [(0,), (1,), (0,), (1,), (0,), (0,)]
    assert "study: 6 at once, 1 rank(s) x 2 thread(s) per cell, 19.5 GiB per rank, GPUs 0 | 1 | 0 | 1 | 0 | 0" \
        in capsys.readouterr().out
    assert study_main([str(path), "--out", str(tmp_path / "gpu"), "--gpus", "0,1", "--cores", "12", "--ranks", "3",
                       "--gpu-memory-per-cell", "19.5"]) == 0  # 21 GiB a cell with three CUDA contexts
    assert [slot.gpus for slot in seen["slots"]] == [(0,), (1,), (0,), (0,)] and seen["slots"][0].memory_gib == 6.5
    assert study_main([str(path), "--out", str(tmp_path / "gpu"), "--gpus", "-1"]) == 2
    assert "--gpus -1: GPU -1 is not among the 2 this study sees\n" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)  # what CUDA_VISIBLE_DEVICES=5 leaves
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert study_main([str(path), "--out", str(tmp_path / "gpu"), "--gpus", "0,1",
                       "--gpu-memory-per-cell", "19.5"]) == 2
    assert capsys.readouterr().err.strip() == ("htfl_dist.study: error: --gpus 0,1: GPU 1 is not among the 1 this "
                                               "study sees (CUDA_VISIBLE_DEVICES=5)")


def test_a_cells_devices_are_named_through_an_inherited_visible_list():
    assert schedule.visible_devices_for((0, 1), None) == "0,1"
    assert schedule.visible_devices_for((1,), "2,3") == "3"  # SLURM gave this job physical GPUs 2 and 3
    assert schedule.visible_devices_for((0, 1), "GPU-aa, GPU-bb") == "GPU-aa,GPU-bb"


def test_cell_command_gets_its_slot(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cell = plan.Cell("k", 0, SMOKE, ("seed=0",))
    command, env = schedule.cell_command(cell, Path("/s"), schedule.Slot((2, 3), 4), ranks=2)
    assert command[0].endswith("torchrun") and command[1:3] == ["--standalone", "--nproc_per_node=2"]
    assert command[-2:] == ["seed=0", "runtime.threads=4"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["OMP_NUM_THREADS"] == "4"
    mine = plan.Cell("k", 0, SMOKE, ("runtime.threads=1", "seed=0"), explicit_keys=frozenset({"runtime.threads"}))
    command, _ = schedule.cell_command(mine, Path("/s"), schedule.Slot((), 4), ranks=1)
    assert command[:3] == [sys.executable, "-m", "htfl_dist.main"] and command[-1] == "seed=0"
    command, env = schedule.cell_command(cell, Path("/s"), schedule.Slot((1,), 4, 6.5), ranks=1)
    assert command[-2:] == ["runtime.threads=4", "runtime.gpu_memory_gib=6.5"] and env["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    capped = plan.Cell("k", 0, SMOKE, ("runtime.gpu_memory_gib=3", "seed=0"),
                       explicit_keys=frozenset({"runtime.gpu_memory_gib"}))
    command, env = schedule.cell_command(capped, Path("/s"), schedule.Slot((1,), 4, 6.5), ranks=1)
    assert "runtime.gpu_memory_gib=6.5" not in command and env["CUDA_VISIBLE_DEVICES"] == "7"


def test_a_failed_cell_is_named_with_the_last_meaningful_line_of_its_own_log(tmp_path):
    """The program's error line (under torchrun, the one its summary repeats after rules of '='),
    else a traceback's last line; never the study's header. Each attempt writes a log of its own,
    the earlier one set aside; a refusal of a held run directory names the holder."""
    run = tmp_path / "cell"
    run.mkdir()
    log = run / schedule.CELL_LOG
    log.write_text("study: python -m htfl_dist.main ...\nTraceback (most recent call last):\n  File x\n"
                   "ValueError: boom\n\n")
    assert schedule.failure_reason(log) == "ValueError: boom"
    log.write_text("htfl_dist: error on rank 0: no data at /x\n" + "-" * 60 + "\nRoot Cause:\n  exitcode  : 2\n"
                   "  traceback : htfl_dist: error on rank 0: no data at /x\n" + "=" * 60 + "\n")
    assert schedule.failure_reason(log) == "htfl_dist: error on rank 0: no data at /x"
    log.write_text("study: python -m htfl_dist.main ...\n")
    assert schedule.failure_reason(log) == "no output"
    assert schedule.failure_reason(run / "missing.log") == "no log"
    with schedule.open_cell_log(run) as first:
        first.write("first attempt\n")
    with schedule.open_cell_log(run) as second:
        second.write("second attempt\n")
    assert log.read_text() == "second attempt\n"
    assert (run / "output.log.1").read_text() == "study: python -m htfl_dist.main ...\n"
    assert (run / "output.log.2").read_text() == "first attempt\n"
    line = (f"htfl_dist: error: run directory {run} is in use by pid 7 on host h (started T); wait for that run "
            f"to end (or stop it), or pass a new --out")
    assert schedule.refused_by_holder(line, run) == "pid 7 on host h (started T)"
    assert schedule.refused_by_holder(line, tmp_path / "other") is None
    assert schedule.exit_status_text(-9) == "killed by SIGKILL" and schedule.exit_status_text(1) == "exit status 1"


# ------------------------------------------------------------------------------------ the table

def _record(name: str, accuracies: list[float], seconds: float = 2.0, server: float = 0.5) -> RunRecord:
    rows = [{"round": r + 1, "test_acc": acc, "test_acc_head": acc, "seconds": seconds, "server_s": server,
             "bytes_up": 1000, "bytes_theory_up": 800} for r, acc in enumerate(accuracies)]
    return RunRecord(Path(name), {"rounds": 4}, None, rows)


def test_seeds_fold_into_mean_and_population_std():
    records = [_record("a", [0.50, 0.90, 0.80]), _record("b", [0.60, 0.94, 0.86], seconds=4.0, server=1.5)]
    row = table.fold("fedproto/dirichlet", records, 4, paper=91.5)
    # best 90 and 94: mean 92, std sqrt(((90-92)^2 + (94-92)^2) / 2) = 2; last 80 and 86: 83 ± 3
    assert row["best_mean"] == pytest.approx(92.0) and row["best_std"] == pytest.approx(2.0)
    assert row["last_mean"] == pytest.approx(83.0) and row["last_std"] == pytest.approx(3.0)
    assert row["difference"] == pytest.approx(0.5)
    assert (row["rounds_done"], row["rounds_planned"], row["seeds"]) == (3, 4, 2)
    assert row["seconds_per_round"] == pytest.approx(3.0) and row["server_share"] == pytest.approx(1.0 / 3.0)
    assert row["up_over_theory"] == pytest.approx(1.25) and row["mb_up_per_round"] == pytest.approx(0.001)
    text = table.markdown([row, table.fold("fml/dirichlet", [], 4, None)])
    assert "| fedproto/dirichlet | 2 | 92.00 ± 2.00 | 83.00 ± 3.00 | 91.50 | +0.50 | 3/4 | 3.00 | 33.3 % |" in text
    assert "| fml/dirichlet | 0 | - | - | - | - | 0/4 | - | - | - | - |" in text
    assert table.csv_text([row]).splitlines()[1].startswith("fedproto/dirichlet,2,92.0,2.0,83.0,3.0,91.5,0.5,3,4,")
    rounds, mean, low, high = table.band(records)
    assert rounds == [1, 2, 3] and mean == pytest.approx([55.0, 92.0, 83.0])
    assert low == pytest.approx([50.0, 90.0, 80.0]) and high == pytest.approx([60.0, 94.0, 86.0])


def test_fednh_weightings_fold_into_their_own_columns_where_a_run_has_them():
    weighted = [_record("a", [0.5, 0.8]), _record("b", [0.6, 0.9])]
    for record, (validclass, labeldist) in zip(weighted, [(0.70, 0.75), (0.80, 0.85)], strict=True):
        record.rows[-1].update(test_acc_validclass=validclass, test_acc_labeldist=labeldist)
    row = table.fold("fednh/global", weighted, 2, paper=None)
    assert (row["validclass_mean"], row["validclass_std"]) == (pytest.approx(75.0), pytest.approx(5.0))
    assert (row["labeldist_mean"], row["labeldist_std"]) == (pytest.approx(80.0), pytest.approx(5.0))
    text = table.markdown([row, table.fold("fednh/local", [_record("c", [0.5])], 2, None)])
    assert "last trained-class acc %" in text and "last label-weighted acc %" in text
    assert "75.00 ± 5.00 | 80.00 ± 5.00 |" in text
    assert "trained-class" not in table.markdown([table.fold("fednh/local", [_record("c", [0.5])], 2, None)])


# ------------------------------------------------------------------------------------ real runs

def _launch_study(study: Path, out: Path, jobs: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "htfl_dist.study", str(study), "--out", str(out),
                             "--jobs", str(jobs), "--progress-every", "1"], cwd=REPO, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.launch
def test_a_killed_study_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path, cache_dir):
    """SIGTERM to the study mid-run: its cells checkpoint (exit 75), the study exits 75; the same
    command again reads finished cells back and resumes the others; every cell's metrics then
    equal those of a study that ran straight through, and its summary carries main's config hash.
    The straight study has a third cell that fails: it is named in one line, the others finish,
    and the exit status counts it."""
    common = {"rounds": 6, "num_clients": 4, "data.cache_dir": str(cache_dir), "data.subsample": 0.01}
    straight_file = write_study(tmp_path, set=common, grid={"algorithm": ["fedproto", "local", "lgfedavg"]},
                                cells={"lgfedavg": {"data.root": str(tmp_path / "no-such-data")}})
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    reference = _launch_study(straight_file, straight, jobs=3)
    output = reference.communicate(timeout=120)[0]
    assert reference.returncode == 101, output
    failed = [line for line in output.splitlines() if "failed (exit status" in line]
    assert len(failed) == 1 and "cell lgfedavg-seed0 failed" in failed[0] and "no-such-data" in failed[0], output
    assert "study: 2/3 cells done, 0 running, 1 failed, 0 waiting" in output
    path = write_study(tmp_path, set=common, grid={"algorithm": ["fedproto", "local"]})
    first = _launch_study(path, killed)
    metrics = killed / "cells" / "fedproto-seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 75, output
    assert (killed / "cells" / "fedproto-seed0" / "PREEMPTED").exists(), output
    assert len(read_metrics(killed / "cells" / "fedproto-seed0")) < 6  # the other rounds: slack under load
    second = _launch_study(path, killed)
    output = second.communicate(timeout=120)[0]
    assert second.returncode == 0, output
    for name in ("fedproto-seed0", "local-seed0"):
        assert maths_only(read_metrics(killed / "cells" / name)) == maths_only(read_metrics(straight / "cells" / name))
        summary = json.loads((killed / "cells" / name / "summary.json").read_text())
        overrides = [f"{key}={value}" for key, value in common.items()]
        expected = resolved_config(str(SMOKE), [*overrides, f"algorithm={name.split('-')[0]}", "seed=0"])
        assert summary["config_hash"] == expected.config_hash()
    table_md = (killed / "table.md").read_text()
    assert "| fedproto | 1 |" in table_md and "| 6/6 |" in table_md
    assert (killed / "table.csv").is_file() and (killed / "curves.png").stat().st_size > 0
    third = _launch_study(path, killed)  # all finished: read back, nothing launched
    output = third.communicate(timeout=60)[0]
    assert third.returncode == 0 and "2 cells, 2 already finished" in output, output


# ------------------------------------------------------------------------------------ a study's safety

STRAIGHT_ROUNDS = 8
"""Enough rounds that a cell left running by a killed study would outlive the checks by far."""


def _study_settings(cache_dir: Path) -> dict:
    return {"rounds": STRAIGHT_ROUNDS, "num_clients": 4, "data.cache_dir": str(cache_dir), "data.subsample": 0.01}


def _lock_record(directory: Path) -> dict:
    from htfl_dist.runtime.bootstrap import LOCK_FILE

    try:
        return json.loads((directory / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _cell_processes(out: Path) -> list[str]:
    """The live processes (pid and command line) of cells in ``out``, wherever they are in the process tree."""
    needle = f"{out}/cells/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command[:200]}")
    return found


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, cache_dir):
    """Two cells run straight through by a study process; while it runs, a second study on its
    directory (what that one printed and returned, and the directory's study record and lock
    record around it, kept for the lock's test)."""
    folder = tmp_path_factory.mktemp("undisturbed")
    path = write_study(folder, set=_study_settings(cache_dir), grid={"algorithm": ["fedproto", "local"]})
    out = folder / "out"
    first = _launch_study(path, out)
    deadline = time.monotonic() + 120
    while not (out / "study.json").is_file() and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.05)  # the first study has claimed the directory; its cells are about to start
    deadline = time.monotonic() + 5
    while _lock_record(out).get("pid") != first.pid and time.monotonic() < deadline:
        time.sleep(0.05)
    before = ((out / "study.json").read_bytes(), _lock_record(out))
    second = subprocess.run([sys.executable, "-m", "htfl_dist.study", str(path), "--out", str(out), "--jobs", "2"],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    after = ((out / "study.json").read_bytes(), _lock_record(out))
    still_running = first.poll() is None
    output = first.communicate(timeout=300)[0]
    return {"path": path, "out": out, "code": first.returncode, "output": output, "pid": first.pid,
            "second": second, "before": before, "after": after, "first_still_running": still_running}


@pytest.mark.launch
def test_a_second_study_on_a_running_studys_directory_is_refused_in_one_line(undisturbed):
    """The study's directory has the run directory's lock: a second study on it ends at once with
    one line naming the first (exit status 2, as a second run on a run's directory) and writes
    nothing, and the first goes on undisturbed, its cells' logs its own."""
    second, out = undisturbed["second"], undisturbed["out"]
    assert undisturbed["first_still_running"], undisturbed["output"]
    assert second.returncode == 2 and second.stdout == "", second.stdout + second.stderr
    assert second.stderr.startswith(f"htfl_dist.study: error: study directory {out} is in use by pid "
                                    f"{undisturbed['pid']} on host "), second.stderr
    assert len(second.stderr.splitlines()) == 1 and second.stderr.rstrip().endswith("or pass a new --out")
    assert undisturbed["after"] == undisturbed["before"]  # neither the study record nor the lock's holder
    assert undisturbed["code"] == 0, undisturbed["output"]
    for name in ("fedproto-seed0", "local-seed0"):
        log = (out / "cells" / name / "output.log").read_text()
        assert log.count("study: ") == 1 and log.startswith("study: "), log  # one study started it
        assert not (out / "cells" / name / "output.log.1").exists()


@pytest.mark.launch
def test_a_sigkilled_study_takes_its_cells_along_and_its_rerun_equals_an_undisturbed_one(undisturbed, tmp_path):
    """SIGKILL to the study while its cells run: the cells get the parent-death SIGTERM, checkpoint
    at their round boundary and are gone within seconds (not running on to the end as orphans that
    hold their run directories); the same command again exits 0 with each row once, its
    accuracies and every cell's metrics those of the study that ran straight through."""
    out = tmp_path / "killed"
    first = _launch_study(undisturbed["path"], out)
    metrics = out / "cells" / "fedproto-seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.poll() is None, first.communicate()[0]
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    killed_at = time.monotonic()
    while _cell_processes(out) and time.monotonic() - killed_at < 20:
        time.sleep(0.1)
    assert _cell_processes(out) == [], f"cells outlived their study: {_cell_processes(out)}"
    gone_after_s = time.monotonic() - killed_at
    # stopped by the SIGTERM at its round boundary, with a checkpoint: not finished by an orphan
    cell = out / "cells" / "fedproto-seed0"
    assert (cell / "PREEMPTED").exists(), (cell / "output.log").read_text()
    assert len(read_metrics(cell)) < STRAIGHT_ROUNDS
    second = _launch_study(undisturbed["path"], out)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output
    assert " failed (" not in output and "run directory is held by" not in output, output
    rows = list(csv.DictReader((out / "table.csv").read_text().splitlines()))
    straight = list(csv.DictReader((undisturbed["out"] / "table.csv").read_text().splitlines()))
    assert [row["cell"] for row in rows] == ["fedproto", "local"]
    accuracy = ("cell", "seeds", "best_mean", "best_std", "last_mean", "last_std", "rounds_done", "rounds_planned")
    assert [{k: row[k] for k in accuracy} for row in rows] == [{k: row[k] for k in accuracy} for row in straight]
    for name in ("fedproto-seed0", "local-seed0"):
        assert maths_only(read_metrics(out / "cells" / name)) == \
            maths_only(read_metrics(undisturbed["out"] / "cells" / name))
    # the killed attempt's log set aside, the resumed attempt's its own
    assert "SIGTERM received" in (out / "cells" / "fedproto-seed0" / "output.log.1").read_text()
    assert (out / "cells" / "fedproto-seed0" / "output.log").read_text().count("study: ") == 1
    print(f"cells gone {gone_after_s:.1f} s after the study's SIGKILL")


@pytest.mark.launch
def test_a_cell_held_by_a_live_process_is_waited_for_and_fails_with_its_own_reason(tmp_path, cache_dir):
    """A rerun finds one cell's run directory held by a live process (what a killed study's
    checkpointing cell is for a moment) and another's lock left by a dead one. The stale lock
    does not matter; the held cell waits, named in a line, and starts once the holder lets go.
    The holder goes on writing error lines into the cell's old log after that; the cell, which
    fails (its data root does not exist), is named with its own last line, not the holder's."""
    from htfl_dist.runtime.bootstrap import LOCK_FILE

    path = write_study(tmp_path, set={**_study_settings(cache_dir), "rounds": 3},
                       grid={"algorithm": ["local", "lgfedavg"]},
                       cells={"lgfedavg": {"data.root": str(tmp_path / "no-such-data")}})
    out = tmp_path / "out"
    plan.claim_directory(out, plan.validate(plan.expand(path)))  # an earlier study's directory
    stale, held = out / "cells" / "local-seed0", out / "cells" / "lgfedavg-seed0"
    stale.mkdir(parents=True)
    (stale / LOCK_FILE).write_text('{"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00 UTC"}\n')
    held.mkdir(parents=True)
    code = ("import sys, time; from pathlib import Path; from htfl_dist.runtime.bootstrap import lock_run_directory; "
            "d = Path(sys.argv[1]); lock = lock_run_directory(d); lock.record_holder(); "
            "log = open(d / 'output.log', 'a'); print('held', flush=True); sys.stdin.readline(); lock.release()\n"
            "while True:\n"
            "    log.write('htfl_dist: error: a line of the process that held the cell\\n'); log.flush(); "
            "time.sleep(0.05)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(held)], cwd=REPO, env=_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        study = _launch_study(path, out)
        lines = []
        for line in study.stdout:
            lines.append(line)
            if f"study: cell lgfedavg-seed0: its run directory is held by pid {holder.pid} on host " in line:
                break
        else:
            raise AssertionError("".join(lines))
        holder.stdin.write("\n")
        holder.stdin.flush()  # it lets go of the directory and writes on into the cell's old log
        output = "".join(lines) + study.communicate(timeout=300)[0]
    finally:
        holder.kill()
        holder.wait()
    assert study.returncode == 101, output
    failed = [line for line in output.splitlines() if " failed (" in line]
    assert len(failed) == 1 and failed[0].startswith("study: cell lgfedavg-seed0 failed (exit status "), output
    assert "no-such-data" in failed[0] and "held the cell" not in failed[0], output
    assert len(read_metrics(stale)) == 3 and json.loads((stale / "summary.json").read_text())["rounds"] == 3
    own = (held / "output.log").read_text()
    assert own.startswith("study: ") and "held the cell" not in own and "no-such-data" in own, own
    assert "held the cell" in (held / "output.log.1").read_text()
