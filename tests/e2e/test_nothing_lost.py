"""Nothing a run has finished is lost: one writer per run directory, files whole or absent (a
full disk included), a resume that refuses to drop metrics rows, and a diverged run that ends
keeping its last good checkpoint."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO, SMOKE, _env, read_metrics
from htfl_dist.errors import EXIT_DISK_FULL, DiskFullError
from htfl_dist.main import main
from htfl_dist.metrics.writer import MetricsFileError, MetricsLog
from htfl_dist.runtime.bootstrap import LOCK_FILE, lock_run_directory


def _one_line(capsys, warnings: bool = False) -> str:
    """The one line a run ended with on stderr (``warnings``: after per-round warning lines)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()
             and not (warnings and line.startswith("htfl_dist: warning: "))]
    assert len(lines) == 1, err
    return lines[0]


def _smoke(out: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", *extra]


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file's bytes, the lock file's included."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- one writer per run directory


def _hold_lock(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory``'s lock, as a running job's rank 0 does."""
    code = ("import sys, time; from pathlib import Path; from htfl_dist.runtime.bootstrap import lock_run_directory; "
            "lock = lock_run_directory(Path(sys.argv[1])); lock.record_holder(); print('held', flush=True); "
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def held_run_dir(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    holder = _hold_lock(directory)
    yield directory, holder
    holder.kill()
    holder.wait()


@pytest.mark.launch
def test_second_run_on_a_held_directory_is_refused_naming_the_holder(held_run_dir, capsys, cache_dir):
    directory, holder = held_run_dir
    before = _snapshot(directory)
    holder_record = (directory / LOCK_FILE).read_text()
    assert main(_smoke(directory, cache_dir, "--resume", "auto")) == 2
    line = _one_line(capsys)
    assert (directory / LOCK_FILE).read_text() == holder_record
    assert f"run directory {directory} is in use by pid {holder.pid} on host " in line, line
    assert "(started 20" in line and "pass a new --out" in line
    assert _snapshot(directory) == before  # nothing written, not even the lock's holder record


@pytest.mark.launch
def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
    holder = _hold_lock(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # the stale record stays
    lock = lock_run_directory(tmp_path)  # but the kernel dropped the lock with the process
    lock.record_holder()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.launch
def test_torchrun_every_rank_learns_the_refusal_and_only_rank0_speaks(held_run_dir, cache_dir):
    directory, holder = held_run_dir
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "htfl_dist.main",
               *_smoke(directory, cache_dir, "--resume", "auto")]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("htfl_dist:")]
    assert len(ours) == 1 and f"in use by pid {holder.pid}" in ours[0], result.stderr
    # the ranks other than 0 exit quietly: torchrun's summary names rank 0 and our line alone
    assert "<NO_OTHER_FAILURES>" in result.stderr, result.stderr
    assert f"traceback : htfl_dist: error: run directory {directory} is in use" in result.stderr
    assert "To enable traceback see" not in result.stderr
    assert sorted(p.name for p in directory.iterdir()) == [LOCK_FILE]


# --------------------------------------------------------------------------- resume needs every row


@pytest.fixture
def checkpointed(single_run) -> Path:
    """A finished 2-round smoke run with a checkpoint after every round (shared: copy, never write)."""
    return single_run("rounds=2", "checkpoint_every=1")[0]


def _damaged_copy(checkpointed: Path, tmp_path: Path, metrics_text: str | None) -> Path:
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    shutil.rmtree(run / "checkpoints" / "round_00002")  # resume from the checkpoint after round 1...
    # ... in a directory whose last run left its holder record (a refused start puts it back)
    (run / LOCK_FILE).write_text('{"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00 UTC"}\n')
    metrics = run / "metrics.jsonl"
    if metrics_text is None:
        metrics.unlink()
    else:
        metrics.write_text(metrics_text)
    return run


@pytest.mark.launch
@pytest.mark.parametrize("damage,state", [
    (lambda rows: "", "is empty"),
    (lambda rows: rows[0][: len(rows[0]) // 2], "lacks them"),  # ... whose row was cut
    (lambda rows: rows[1] + "\n", "lacks them"),  # the row of round 1 deleted, round 2's kept
    (None, "is missing"),
])
def test_resume_refuses_when_the_checkpointed_rounds_rows_are_gone(checkpointed, tmp_path, capsys, cache_dir,
                                                                   damage, state):
    rows = (checkpointed / "metrics.jsonl").read_text().splitlines()
    run = _damaged_copy(checkpointed, tmp_path, None if damage is None else damage(rows))
    before = _snapshot(run)
    assert main(_smoke(run, cache_dir, "rounds=2", "--resume", "auto")) == 2
    line = _one_line(capsys)
    assert "cannot resume after round 1" in line and state in line, line
    assert "rows of rounds 1;" in line and "put the run's metrics.jsonl back" in line, line
    assert _snapshot(run) == before


def test_resume_keeps_the_rows_it_vouches_for_and_drops_later_ones(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"round": r, "test_acc": r / 10}) + "\n" for r in (1, 2, 3)))
    log = MetricsLog(metrics)
    log.load_existing(2, required_rounds=[1, 2])
    assert [row["round"] for row in log.rows] == [1, 2]
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2]
    with pytest.raises(MetricsFileError, match=r"lacks them \(cut or edited\), .* rows of rounds 3-4, 6;"):
        MetricsLog(metrics).load_existing(6, required_rounds=[1, 2, 3, 4, 6])
    assert [row["round"] for row in read_metrics(tmp_path)] == [1, 2]  # a refused resume rewrites nothing


@pytest.mark.launch
def test_manifest_lists_the_metric_rounds(checkpointed):
    manifest = json.loads((checkpointed / "checkpoints" / "round_00002" / "MANIFEST.json").read_text())
    assert manifest["metric_rounds"] == [1, 2]


# --------------------------------------------------------------------------- disk full


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 70 MiB (needs root): room for one smoke checkpoint (53 MB), not two."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.mark.launch
def test_disk_full_while_checkpointing_is_one_line_and_the_previous_checkpoint_resumes(small_disk, capsys,
                                                                                       cache_dir):
    run = small_disk / "run"
    status = main(_smoke(run, cache_dir, "rounds=3", "checkpoint_every=1"))
    line = _one_line(capsys)
    assert status == EXIT_DISK_FULL, line
    assert line.startswith("htfl_dist: error: disk full (no space left) writing ") and "needed " in line, line
    assert f"{run}/checkpoints/round_00002/" in line and "--resume auto" in line, line
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["round_00001"], checkpoints  # no partial round_00002/
    assert not list(run.rglob("*.tmp"))
    # the previous checkpoint is whole: a resume that saves no more checkpoints finishes the run
    assert main(_smoke(run, cache_dir, "rounds=3", "--resume", "auto")) == 0
    capsys.readouterr()
    assert [row["round"] for row in read_metrics(run)] == [1, 2, 3]


@pytest.fixture
def full_disk(small_disk):
    """The small tmpfs with not one byte left (an empty file or directory still fits)."""
    with open(small_disk / "filler", "wb", buffering=0) as handle, pytest.raises(OSError):
        while True:
            handle.write(b"\0" * (1 << 20))
    with open(small_disk / "filler", "ab", buffering=0) as handle:
        while True:
            try:
                handle.write(b"\0")
            except OSError:
                break
    return small_disk


@pytest.mark.parametrize("check", [False, True], ids=["start", "check"])
def test_a_run_directory_on_a_full_disk_is_the_disk_full_line_and_leaves_nothing(full_disk, capsys, check):
    """Was exit 2 ('cannot write the run directory ... No space left on device') with the directory and
    an empty lock file left behind: now the disk-full line and status 74 (docs/running.md), from a
    start and from --check, before anything is made there."""
    run = full_disk / "run"
    assert main([*(["--check"] if check else []), "--config", str(SMOKE), "--out", str(run), "rounds=1"]) == \
        EXIT_DISK_FULL
    line = _one_line(capsys)
    assert line == (f"htfl_dist: error: disk full (no space left) writing {run}: needed more, 0 bytes free there; "
                    f"free space (or point --out elsewhere), then run again with --resume auto"), line
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_study_directory_on_a_full_disk_is_the_disk_full_line_without_a_resume_flag(full_disk, capsys):
    """Was exit 2 and advice to use --resume auto, which the study's command line does not have."""
    from htfl_dist.study.__main__ import main as study_main

    out = full_disk / "study"
    assert study_main([str(REPO / "studies" / "fedktl_table1.yaml"), "--out", str(out)]) == EXIT_DISK_FULL
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"htfl_dist.study: error: disk full (no space left) writing {out}/"), lines[0]
    assert lines[0].endswith("free space (or point --out elsewhere), then run the same command again: the study "
                             "goes on where it stopped"), lines[0]
    assert "--resume" not in lines[0]


def test_a_metrics_row_that_does_not_fit_is_taken_back(small_disk):
    metrics = small_disk / "metrics.jsonl"
    log = MetricsLog(metrics)
    log.append({"round": 1, "test_acc": 0.5})
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as handle, pytest.raises(OSError):
        while True:
            handle.write(b"\0" * (1 << 20))
    with open(filler, "r+b") as handle:  # room for part of the row: the write fails half-way
        handle.truncate(filler.stat().st_size - 4096)
    row = {"round": 2, "test_acc": 0.25, "padding": "x" * 20000}
    size = len(json.dumps(row, sort_keys=True)) + 1
    with pytest.raises(DiskFullError, match=rf"disk full \(no space left\) writing {metrics}: needed 19.6 KiB "
                                            rf"\({size} bytes\)"):
        log.append(row)
    assert [row["round"] for row in read_metrics(small_disk)] == [1]  # whole lines only
    assert [row["round"] for row in log.rows] == [1]


@pytest.mark.launch
def test_a_write_past_the_file_size_limit_is_a_disk_full_line(tmp_path):
    """``ulimit -f`` (RLIMIT_FSIZE) with SIGXFSZ ignored: the write fails with EFBIG."""
    code = ("import resource, signal, sys; from pathlib import Path; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); from htfl_dist.atomic import publish_bytes; "
            "from htfl_dist.errors import DiskFullError\n"
            "try:\n    publish_bytes(Path(sys.argv[1]) / 'big.pt', b'x' * 100000)\n"
            "except DiskFullError as exc:\n    print(exc)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=60)
    assert f"disk full (file size limit) writing {tmp_path}/big.pt: needed 97.7 KiB (100000 bytes)" in result.stdout, (
        result.stdout + result.stderr)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


# --------------------------------------------------------------------------- training that diverged


@pytest.mark.launch
def test_lr_that_overflows_every_loss_ends_after_max_diverged_rounds(tmp_path, capsys, cache_dir):
    run = tmp_path / "run"
    status = main(_smoke(run, cache_dir, "train.lr=1e30", "rounds=5", "checkpoint_every=1",
                         "train.max_diverged_rounds=2"))
    line = _one_line(capsys, warnings=True)  # each round warns that it left the NaN uploads out
    assert status == 1, line
    assert "training diverged: every participating client's loss was not finite in rounds 1-2" in line, line
    assert "train.lr (now 1e+30)" in line and "no checkpoint was kept" in line
    assert [row["round"] for row in read_metrics(run)] == [1, 2]
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


@pytest.mark.launch
def test_divergence_after_good_rounds_keeps_the_last_good_checkpoint(tmp_path, capsys, cache_dir, monkeypatch):
    """Losses turn NaN from round 2 on: round 1's checkpoint is the one kept, rounds 2 and 3 (due
    for a checkpoint too) are not saved, and the run ends after round 3 with status 1."""
    from htfl_dist.algorithms import get_algorithm

    client_class = get_algorithm("fedproto").client
    original = client_class.train

    def train(self, client, knowledge, round_index, generator):
        result = original(self, client, knowledge, round_index, generator)
        if round_index >= 1:
            result.loss_sum = math.nan
        return result

    monkeypatch.setattr(client_class, "train", train)
    run = tmp_path / "run"
    status = main(_smoke(run, cache_dir, "rounds=5", "checkpoint_every=1", "train.max_diverged_rounds=2"))
    line = _one_line(capsys)
    assert status == 1, line
    assert "not finite in rounds 2-3" in line and f"the last good checkpoint is {run}/checkpoints/round_00001" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round_00001"]
    assert [row["round"] for row in read_metrics(run)] == [1, 2, 3]


def test_the_divergence_rule_needs_every_trained_client_non_finite():
    import torch

    from htfl_dist.runtime.exchange import every_loss_diverged as _every_loss_diverged

    def report(loss, samples):
        return {"train": torch.tensor([[loss, samples]], dtype=torch.float64)}

    def no_training():
        return {"train": torch.empty(0, 2, dtype=torch.float64)}

    assert _every_loss_diverged({0: report(math.nan, 10), 1: report(math.inf, 5), 2: no_training()})
    assert not _every_loss_diverged({0: report(math.nan, 10), 1: report(3.0, 5)})
    assert not _every_loss_diverged({0: report(math.nan, 0), 1: no_training()})  # nobody trained
    assert not _every_loss_diverged({})


def test_the_divergence_limit_is_not_part_of_the_experiment():
    """Giving up sooner or later does not change what a round computes: same hash, and a run may
    resume with another limit."""
    from htfl_dist.resolution import resolved_config

    default = resolved_config(str(SMOKE), [])
    assert default.train.max_diverged_rounds == 3
    assert resolved_config(str(SMOKE), ["train.max_diverged_rounds=7"]).config_hash() == default.config_hash()
    assert "max_diverged_rounds" not in default.experiment()["train"]
