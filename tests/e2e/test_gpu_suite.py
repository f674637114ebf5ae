"""The GPU suite (bench/gpu_prepare.sh, bench/gpu_suite.sh) kept working on a CPU: its parsing of
the reference's log and of nvidia-smi's samples against hand-written examples, and a dry run of
every step at toy sizes (``--device cpu --tiny``). The reference code is fetched from GitHub, which
a CI machine cannot reach: name a clone in HTFL_HTFLLIB to put it in the dry run too (its FedProto
must then give our first-round accuracy on the same split)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, _env

spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "bench" / "gpu_suite.py")
assert spec and spec.loader
gpu_suite = importlib.util.module_from_spec(spec)
sys.modules["gpu_suite"] = gpu_suite
spec.loader.exec_module(gpu_suite)

REFERENCE_LOG = """\
-------------Round number: 0-------------

Evaluate heterogeneous models
Averaged Test Accurancy: 0.1000
-------------------------------------------------- 2.5

-------------Round number: 1-------------
Averaged Test Accurancy: 0.6282
-------------------------------------------------- 1.25
-------------Round number: 2-------------
Averaged Test Accurancy: 0.8694
-------------------------------------------------- 1.75
Best accuracy.
0.8694
"""


def test_reference_log_gives_iteration_seconds_and_accuracies(tmp_path):
    log = tmp_path / "reference.log"
    log.write_text(REFERENCE_LOG)
    seconds, accuracy = gpu_suite.reference_figures(log)
    assert seconds == [2.5, 1.25, 1.75]
    assert accuracy == [0.1, 0.6282, 0.8694]
    assert gpu_suite.per_round_s(seconds) == 1.5  # the first iteration (warm-up) left out
    assert gpu_suite.per_round_s([4.0]) == 4.0
    assert gpu_suite.per_round_s([]) is None


def test_gpu_utilisation_is_averaged_over_the_timed_rounds_only(tmp_path, monkeypatch):
    """A stand-in nvidia-smi prints samples in the real format (timestamp, %, MiB); utilisation
    is averaged over the run's last seconds, memory is the peak of the whole run."""
    now = time.time()
    stamp = lambda t: time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + ".250"  # noqa: E731
    lines = [f"{stamp(now - 30)}, 0, 500", f"{stamp(now - 20)}, 10, 9000", f"{stamp(now - 4)}, 80, 1000",
             f"{stamp(now - 2)}, 100, 1200", "garbage line"]
    samples_file = tmp_path / "gpu.csv"
    samples_file.write_text("\n".join(lines) + "\n")
    sampler = gpu_suite.GpuSampler(samples_file)
    sampler.process = object()  # as if nvidia-smi had been started
    samples = sampler.samples()
    assert [s[1:] for s in samples] == [(0.0, 500.0), (10.0, 9000.0), (80.0, 1000.0), (100.0, 1200.0)]
    launched = gpu_suite.Launch(0, 40.0, samples, ended=now)
    assert launched.gpu_util(10) == 90.0
    assert launched.gpu_util() == 47.5
    assert launched.gpu_mem_mib == 9000.0
    assert gpu_suite.Launch(0, 1.0).gpu_util() is None


def test_projection_spreads_client_time_over_seven_gpus():
    line = " ".join(gpu_suite.projection(client_s=14.0, server_s=1.0, s_round=16.0, clients=20))
    # 20 clients on 7 GPUs: at most 3 each, so 14 × 3/20 = 2.1, plus server 1.0 and the rest 1.0
    assert "= 4.10 s/round" in line and "1.14 h for 1000 rounds" in line and "Projection, not a measurement" in line
    assert gpu_suite.projection(None, 1.0, 2.0, 20) == ["Projection: not made (the run gave no rounds)."]


def _section(summary: str, number: int) -> str:
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", summary, flags=re.M | re.S)
    assert match, f"section {number} missing:\n{summary}"
    return match[0]


def test_a_capped_step_leaves_no_process_in_another_session():
    """torchrun's ranks run in sessions of their own: killing the step's process group alone
    leaves them running beside the next step."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              "time.sleep(60)")
    step = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 20
    while not (rank := _children(step.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank, "the stand-in for torchrun started no rank"
    gpu_suite.kill_tree(step.pid)
    step.wait(timeout=10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{rank[0]}") and _state(rank[0]) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{rank[0]}") or _state(rank[0]) == "Z"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in out.split()]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize(("steps", "message"), [
    ("2", "step 2 compares step 1's runs"), ("0,7", "numbers from 1 to 6"), ("three", "separated by commas"),
])
def test_steps_that_cannot_run_are_refused(tmp_path, capsys, steps, message):
    (tmp_path / "fmnist").mkdir()
    with pytest.raises(SystemExit) as stopped:
        gpu_suite.parse_args([str(tmp_path), str(tmp_path / "out"), "--device", "cpu", "--steps", steps])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_step_1a_lists_the_failed_tests_from_pytests_summary(tmp_path):
    log = tmp_path / "1_graphs_equal_eager.log"
    log.write_text("...FF.\n_ test_a[cuda] _\nE  RuntimeError: capture FAILED, mid-line\n"
                   "=== short test summary info ===\n"
                   "FAILED tests/x.py::test_a[cuda] - assert 1 == 2\nFAILED tests/x.py::test_b[cuda]\n"
                   "SKIPPED [1] tests/y.py:3: no GPU\n2 failed, 4 passed\n")
    assert gpu_suite.failed_tests(log) == ["  - FAILED tests/x.py::test_a[cuda] - assert 1 == 2",
                                           "  - FAILED tests/x.py::test_b[cuda]"]
    assert gpu_suite.failed_tests(tmp_path / "missing.log") == []  # the step was cut before its log


@pytest.mark.launch
def test_dry_run_of_the_whole_suite_on_the_cpu(tmp_path):
    env = _env()
    env["PYTHON"] = sys.executable
    prepared, out = tmp_path / "prepared", tmp_path / "out"
    reference = os.environ.get("HTFL_HTFLLIB")
    prepare = ["bash", str(REPO / "bench" / "gpu_prepare.sh"), str(prepared), "--no-wheels"]
    prepare += ["--htfllib", reference] if reference else ["--no-reference"]
    done = subprocess.run(prepare, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (prepared / "fmnist").iterdir()) == [
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
        "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]

    began = time.monotonic()
    suite = subprocess.run(["bash", str(REPO / "bench" / "gpu_suite.sh"), str(prepared), str(out), "--device", "cpu",
                            "--tiny", "--budget-s", "900", "--work", str(tmp_path / "work")],
                           env=env, capture_output=True, text=True, timeout=1000)
    assert suite.returncode == 0, suite.stdout + suite.stderr
    assert time.monotonic() - began < 900
    summary = (out / "summary.md").read_text()

    graphs = re.search(r"^## 1a\. .*?(?=^## |\Z)", summary, flags=re.M | re.S)
    assert graphs and "test_concurrent_clients.py on cpu: rc 0 (passed" in graphs[0], summary
    assert "bench/compile_step.py: not in a CPU dry run" in summary
    assert "SKIPPED" in (out / "logs" / "1_graphs_equal_eager.log").read_text()  # the GPU test, saying why
    side = _section(summary, 1)
    for run in ("ours_1proc", "ours_graphs", "ours_graphs_concurrent", "ours_concurrent4", "ours_2ranks", "ours_vmap",
                "ours_3ranks", "ours_2ranks_graphs_concurrent"):
        row = re.search(rf"^\| {run} \| ([\d.]+) \| [\d.]+ \| n/a \| n/a \| ([\d., ]+) \(rc 0\) \|$", side, flags=re.M)
        assert row, f"{run} row missing or failed:\n{side}"
        assert len(row[2].split(",")) == 2  # accuracy after each of the 2 rounds
    if reference:
        ours = re.search(r"^\| ours_1proc \| .* \| ([\d.]+), ", side, flags=re.M)
        theirs = re.search(r"^\| HtFLlib FedProto \(\w{7}\) \| [\d.]+ \| [\d.]+ \| n/a \| n/a \| ([\d.]+) \(rc 0\) \|$",
                           side, flags=re.M)
        assert ours and theirs and ours[1] == theirs[1], side
        assert "× the reference's round" in side
    else:
        assert "| HtFLlib FedProto | not prepared" in side
    determinism = _section(summary, 2)  # 2 ranks, recorded (eager on a CPU) and side by side (4 threads)
    for run in ("ours_2ranks", "ours_graphs", "ours_graphs_concurrent", "ours_concurrent4",
                "ours_2ranks_graphs_concurrent"):
        assert f"- {run}: identical: every round's test_acc, test_acc_head, train_loss equal (2 rounds)" in determinism

    paper = _section(summary, 3)
    assert len(re.findall(r"^\| (cnn|googlenet|mobilenet_v2|resnet\d+) \| [\d.]+ \| [\d.]+ M \| [\d.]+ \|", paper,
                          flags=re.M)) == 8
    assert re.search(r"\(rc 0\): [\d.]+ s/round \(clients [\d.]+ s, server [\d.]+ s\)", paper), paper
    assert "**Projection, not a measurement**" in paper
    assert re.search(r"one process with `train.cuda_graphs=auto train.concurrent_clients=0` \(rc 0\): [\d.]+ s/round",
                     paper), paper

    server = _section(summary, 4)
    assert re.search(r"C=10 pairs=100 S=5 device=cpu: round 2: [\d.]+ s per update", server), server
    assert re.search(r"C=100 pairs=200 S=5 device=cpu: round 2: [\d.]+ s per update", server), server
    assert "In step 3's FedTGP round the server took" in server

    private = _section(summary, 5)
    assert re.search(r"- plain: client s/round [\d.]+ \(rc 0\)", private), private
    assert re.search(r"- dpsgd: client s/round [\d.]+ \(rc 0\)", private), private
    assert re.search(r"DP-SGD \(secret noise, ε = 4\) costs [\d.]+× a plain round's client time", private)
    assert re.search(r"4 cells, `--jobs 2 --cores \d+`: [\d.]+ s wall \(rc 0\)", private), private
    assert re.search(r"4 cells, `--jobs 1`: [\d.]+ s wall \(rc 0\)", private), private
    assert "Not prepared: DIR has no pfl-wheels/" in _section(summary, 6)  # prepared --no-wheels
    assert (out / "results.json").exists() and (out / "logs" / "1_ours_1proc.log").exists()
