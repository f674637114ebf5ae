"""Real multi-process runs on real Fashion-MNIST: world-size invariance, bytes, resume.

These launch the program exactly as the README does (python -m, torchrun over Gloo,
mpirun over mpi4py) and compare what they write.
"""
from __future__ import annotations

import json

import pytest

from conftest import SMOKE, launch, maths_only, read_metrics, run_program, run_smoke

_run = run_smoke


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """World size 1: server and all clients in one process."""
    out = tmp_path_factory.mktemp("ws1")
    return out, _run("single", 1, out, cache_dir)


@pytest.mark.launch
@pytest.mark.parametrize("launcher,nproc,overrides", [
    ("torchrun", 4, ("runtime.placement_work=flops",)),  # 3 client ranks, placed by cost: the same numbers
    ("mpirun", 3, ()),
    ("torchrun", 2, ("runtime.server_hosts_clients=true",)),  # rank 0 serves and trains: the same numbers
])
def test_world_size_invariance(reference, launcher, nproc, overrides, tmp_path, cache_dir):
    _, expected = reference
    rows = _run(launcher, nproc, tmp_path, cache_dir, *overrides)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in expected]
    assert [r["test_acc_head"] for r in rows] == [r["test_acc_head"] for r in expected]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in expected]


def test_outputs_and_bytes(reference):
    out, rows = reference
    for row in rows:
        for key in ("round", "test_acc", "test_acc_head", "test_acc_std", "train_loss", "bytes_up",
                    "bytes_down", "bytes_theory_up", "bytes_theory_down", "seconds", "client_s",
                    "comm_s", "server_s"):
            assert key in row, key
        assert 0.0 <= row["test_acc"] <= 1.0
        # FedProto uploads K·|C_i| floats per client; ids and headers cost < 5 % on top
        assert row["bytes_theory_up"] > 0
        assert 1.0 <= row["bytes_up"] / row["bytes_theory_up"] <= 1.05
    # learning happens: accuracy after 3 rounds well above chance (10 classes)
    assert rows[-1]["test_acc"] > 0.3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_test_acc"] == max(r["test_acc"] for r in rows)
    assert summary["last_test_acc"] == rows[-1]["test_acc"]
    assert summary["versions"]["torch"]
    assert (out / "config.yaml").is_file()


@pytest.mark.integration
def test_local_sends_nothing(single_run):
    _, rows = single_run("algorithm=local", "rounds=2")  # the conformance test's run, shared
    assert all(r["bytes_up"] == 0 and r["bytes_theory_up"] == 0 for r in rows)
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)


@pytest.mark.launch
def test_resume_matches_uninterrupted_run(reference, tmp_path, cache_dir):
    """Stop after round 2 (checkpoint), resume on a different world size, finish round 3."""
    _, expected = reference
    first = _run("single", 1, tmp_path, cache_dir, "rounds=2", "checkpoint_every=2")
    assert len(first) == 2
    assert (tmp_path / "checkpoints" / "round_00002" / "MANIFEST.json").is_file()
    result = launch("torchrun", 3, ["--config", str(SMOKE), "--out", str(tmp_path), "--resume", "auto",
                                    f"data.cache_dir={cache_dir}", "checkpoint_every=2"])
    assert result.returncode == 0, result.stdout + result.stderr
    resumed = read_metrics(tmp_path)
    assert [r["test_acc"] for r in resumed] == [r["test_acc"] for r in expected]


def test_existing_run_directory_is_not_overwritten(reference, tmp_path, cache_dir):
    out, _rows = reference
    before = (out / "metrics.jsonl").read_text()
    result = run_program(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}"])
    assert result.returncode == 2
    assert "already holds a run" in result.stderr
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.launch
def test_fedtgp_partial_participation_world_size_invariant(single_run, tmp_path, cache_dir):
    """FedTGP with ρ = 0.5: 1 rank and 4 ranks agree, and the server trains on exactly the
    participants' (prototype, class) pairs each round (two rounds: two draws of participants;
    the one-process run is the conformance test's, which compares it with 3 ranks)."""
    import numpy as np

    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition
    from htfl_dist.runtime.placement import sample_participants

    overrides = ("algorithm=fedtgp", "rounds=2", "join_ratio=0.5", "algo.server_epochs=20")
    _, single = single_run(*overrides)
    spread = _run("torchrun", 4, tmp_path / "ws4", cache_dir, *overrides)
    assert [r["round"] for r in single] == [1, 2]
    assert [r["test_acc"] for r in spread] == [r["test_acc"] for r in single]
    assert [r["margin"] for r in spread] == [r["margin"] for r in single]
    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", *overrides])
    counts = prepare_partition(config.data, config.num_clients, config.seed).class_counts
    for row in single:
        participants = sample_participants(config.seed, row["round"] - 1, config.num_clients, 0.5)
        assert len(participants) == 3
        assert row["server_pairs"] == int(np.count_nonzero(counts[participants]))
        assert row["bytes_theory_up"] == row["server_pairs"] * 512 * 4
        assert row["margin"] > 0 and row["server_loss"] > 0
        assert len(row["class_margin_global"]) == 10


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_diverged_client_ends_every_rank_loudly(launcher, tmp_path, cache_dir):
    """A NaN upload is caught by the server, which names the client and takes all ranks down."""
    import time

    began = time.perf_counter()
    result = launch(launcher, 3, ["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                                  "train.lr=1e12", "rounds=2", "on_bad_upload=fail"], timeout=120)
    assert result.returncode != 0
    assert "client 0 sent NaN/Inf values" in result.stderr
    assert time.perf_counter() - began < 90
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.integration
def test_diverged_clients_are_skipped_and_the_run_goes_on(tmp_path, cache_dir):
    """on_bad_upload=skip (default): NaN uploads are left out with a warning naming the client
    (rank 0 screens every upload, so one process shows what any world size does); every row is
    written, and since no round aggregated anything the run ends in one line, status 1."""
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                          "train.lr=1e12", "rounds=2"])
    assert result.returncode == 1, result.stderr
    assert "warning: round 1: left client 0 out: client 0 sent NaN/Inf values" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("htfl_dist: error: no round of this run aggregated")
    rows = read_metrics(tmp_path)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["skipped_clients"] == list(range(6))
    assert rows[0]["server_skipped"] is True  # nothing left to learn from: last knowledge kept, not erased


@pytest.mark.launch
@pytest.mark.parametrize("launcher,nproc,algorithm", [
    ("torchrun", 3, "lgfedavg"),  # the lent state is the compact record: a base without its head
    ("torchrun", 4, "fedproto"),  # three client ranks; momentum buffers travel with the client
    ("mpirun", 3, "fedproto"),
])
def test_participants_lent_for_a_round_change_no_number(launcher, nproc, algorithm, tmp_path, cache_dir):
    """Half the clients a round, so the sample falls unevenly on the home ranks and some clients
    train on another rank (counted in summary.json): every row is the one-process row, and
    runtime.rebalance=off, where nobody moves, gives them too."""
    common = (f"algorithm={algorithm}", "num_clients=8", "join_ratio=0.5", "rounds=3", "train.momentum=0.9",
              "runtime.placement_work=samples")
    expected = maths_only(_run("single", 1, tmp_path / "single", cache_dir, *common))
    assert maths_only(_run(launcher, nproc, tmp_path / "lent", cache_dir, *common)) == expected
    summary = json.loads((tmp_path / "lent" / "summary.json").read_text())
    assert summary["clients_trained_away_from_home"] > 0
    if launcher == "torchrun" and nproc == 3:
        home = _run(launcher, nproc, tmp_path / "home", cache_dir, *common, "runtime.rebalance=off")
        assert maths_only(home) == expected
        assert "clients_trained_away_from_home" not in json.loads((tmp_path / "home" / "summary.json").read_text())
