"""What a user sees and what other tools read: start-up and in-round progress lines, the
``--resume auto`` notice, TensorBoard scalars and HtFLlib's .h5 arrays, read back after a real run
and after a resume."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO, SMOKE, _env, launch, read_metrics, run_program
from htfl_dist.metrics.sinks import row_scalars, scalar_tag
from htfl_dist.metrics.writer import TrainingProgress


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_tags_group_row_keys_and_skip_what_is_not_a_number():
    row = {"round": 3, "test_acc": 0.5, "train_loss": None, "bytes_up": 10, "server_s": 0.1,
           "margin": 2.0, "server_skipped": True, "skipped_clients": [1]}
    assert row_scalars(row) == {"accuracy/test_acc": 0.5, "bytes/bytes_up": 10.0, "time/server_s": 0.1,
                                "algorithm/margin": 2.0}
    assert scalar_tag("test_acc_head") == "accuracy/test_acc_head"


def test_training_progress_speaks_only_in_long_rounds(capsys):
    quiet = TrainingProgress(every_s=3600.0, where="rank 2")
    quiet.start(4, 3)
    for _ in range(3):
        quiet.client_done()
    chatty = TrainingProgress(every_s=1e-9, where="rank 2")
    chatty.start(4, 3)
    for _ in range(3):
        chatty.client_done()
    lines = capsys.readouterr().out.splitlines()
    # not after the last client: the round line follows at once
    assert [line.split(" (")[0] for line in lines] == ["round 4: rank 2 trained 1/3 clients",
                                                       "round 4: rank 2 trained 2/3 clients"]


@pytest.fixture(scope="module")
def two_rounds_then_resume(tmp_path_factory, cache_dir):
    """Round 1 with a checkpoint, then --resume auto to round 3 on 3 ranks, outputs on."""
    out = tmp_path_factory.mktemp("outputs")
    common = ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", "output.tensorboard=true",
              "output.htfllib_h5=true", "checkpoint_every=1", "runtime.placement_work=samples"]
    first = run_program([*common, "rounds=1"])
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = launch("torchrun", 3, [*common, "rounds=3", "--resume", "auto", "output.progress_every_s=1e-9"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return out, first.stdout, resumed.stdout


@pytest.mark.launch
def test_start_up_is_narrated(two_rounds_then_resume):
    out, first, resumed = two_rounds_then_resume
    assert first.startswith("htfl_dist: fedproto, 6 clients, 1 round; 1 rank via single")
    assert f"run directory {out}" in first.splitlines()[0]
    for expected in ("placement: rank 0 is the server and hosts all 6 clients", "data: fmnist, 6 clients, 10 classes",
                     "start-up: every rank has its data and models"):
        assert expected in first
    assert "3 ranks via torchrun" in resumed
    assert "placement: rank 0 is the server; clients per rank (share of samples): rank 1: 3 (" in resumed
    assert "resume: continuing after round 1 from" in resumed
    # every client rank tells how far its clients are inside a round
    assert "round 2: rank 1 trained 1/3 clients" in resumed and "round 3: rank 2 trained 2/3 clients" in resumed


@pytest.mark.launch
def test_tensorboard_holds_each_round_once_after_a_resume(two_rounds_then_resume):
    out, _, _ = two_rounds_then_resume
    rows = read_metrics(out)
    scalars = _scalars(out / "tensorboard")
    assert scalars["accuracy/test_acc"] == [(row["round"], pytest.approx(row["test_acc"])) for row in rows]
    assert [step for step, _ in scalars["accuracy/test_acc_head"]] == [1, 2, 3]
    assert [step for step, _ in scalars["algorithm/proto_drift"]] == [2, 3]  # no drift before round 2
    assert {"loss/train_loss", "bytes/bytes_up", "time/server_s", "accuracy/test_acc_head"} <= set(scalars)


@pytest.mark.launch
def test_htfllib_h5_matches_the_metrics(two_rounds_then_resume):
    out, _, _ = two_rounds_then_resume
    rows = read_metrics(out)
    with h5py.File(out / "fmnist_fedproto_test_0.h5", "r") as handle:
        assert set(handle) == {"rs_round", "rs_test_acc", "rs_train_loss", "rs_test_auc"}
        np.testing.assert_array_equal(handle["rs_round"][()], [1, 2, 3])
        np.testing.assert_allclose(handle["rs_test_acc"][()], [row["test_acc"] for row in rows])
        np.testing.assert_allclose(handle["rs_train_loss"][()], [row["train_loss"] for row in rows])
        np.testing.assert_allclose(handle["rs_test_auc"][()], [row["test_auc"] for row in rows])
    assert not list(out.glob(".*.tmp"))  # the atomic rewrite leaves no temp file behind


@pytest.mark.integration
def test_resume_auto_without_checkpoint_says_it_starts_over(tmp_path, cache_dir):
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path), "--resume", "auto", "rounds=1",
                         f"data.cache_dir={cache_dir}"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resume: no complete checkpoint in {tmp_path}; starting from round 1" in result.stdout


@pytest.mark.launch
def test_tensorboard_missing_is_one_line_before_anything_starts(tmp_path, cache_dir):
    """A python without tensorboard gets exit 2 and the install hint (simulated by hiding the package)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "tensorboard.py").write_text("raise ImportError('hidden by the test')\n")
    env = _env()
    env["PYTHONPATH"] = f"{blocker}{os.pathsep}{env['PYTHONPATH']}"
    result = subprocess.run([sys.executable, "-m", "htfl_dist.main", "--config", str(SMOKE), "--out",
                             str(tmp_path / "run"), "output.tensorboard=true"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pip install -e .[tensorboard]" in result.stderr
    assert not (tmp_path / "run").exists()


def test_generated_image_grids_are_written_when_the_images_change(tmp_path):
    import torch
    from PIL import Image

    from htfl_dist.metrics.generated import GeneratedImageGrids
    from htfl_dist.payload import Field

    spec = (Field("class_ids", torch.int64), Field("images", torch.float32, (1, 4, 4)))
    grids = GeneratedImageGrids(tmp_path, spec)
    images = torch.linspace(-1, 1, 3 * 16).reshape(3, 1, 4, 4)
    assert grids.save(1, {"images": images[:0]}) is None  # nothing generated yet
    first = grids.save(2, {"images": images})
    assert first == tmp_path / "generated" / "round_00002.png"
    picture = Image.open(first)
    # 3 tiles of 4 px enlarged 14x (to at least 56 px) with 2 px gaps, greyscale
    assert picture.size == (3 * 56 + 2 * 2, 56) and picture.mode == "L"
    assert picture.getpixel((0, 0)) == 0 and picture.getpixel((3 * 56 + 3, 55)) == 255  # -1 → black, 1 → white
    assert picture.getpixel((56, 0)) == 255  # the gap between tiles
    assert grids.save(3, {"images": images.clone()}) is None  # unchanged: no new file
    assert grids.save(4, {"images": -images}) is not None
    assert sorted(p.name for p in (tmp_path / "generated").iterdir()) == ["round_00002.png", "round_00004.png"]
    assert not GeneratedImageGrids(tmp_path, (Field("protos", torch.float32, (8,)),)).enabled


# ------------------------------------------------------------------ OS errors on the outputs: one line each


def test_os_errors_on_run_outputs_name_the_path_the_operation_and_errno(tmp_path):
    """A directory where metrics.jsonl belongs (or a file where a directory belongs) used to end
    the run with an IsADirectoryError traceback; every writer and reader of the run's files says
    instead what it attempted, on which path, and the OS's reason."""
    from htfl_dist.atomic import OutputError
    from htfl_dist.metrics.writer import MetricsLog, read_rows, write_json

    metrics, eisdir = tmp_path / "metrics.jsonl", "Is a directory (EISDIR)"
    metrics.mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory belongs")
    attempts = [
        (lambda: MetricsLog(metrics).append({"round": 1}), f"cannot append a row to {metrics}: {eisdir}"),
        (lambda: read_rows(metrics), f"cannot read {metrics}: {eisdir}"),
        (lambda: write_json(metrics, {}), f"cannot replace {metrics}: {eisdir}"),
        (lambda: write_json(blocker / "x.json", {}), f"cannot create the directory {blocker}: File exists (EEXIST)"),
    ]
    for attempt, line in attempts:
        with pytest.raises(OutputError) as info:
            attempt()
        assert str(info.value) == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "metrics.jsonl"]  # no temp file left
