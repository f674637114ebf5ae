"""Buffered asynchronous aggregation (participation.mode=async) in whole runs: each row is one
server step of K uploads on the simulated clock; a resumed run continues the same steps (the
clients in flight and the versions they started from are in the checkpoint); FedTGP's server
trains on the buffer, LG-FedAvg's takes FedBuff steps; 1 process and 3 ranks give the same numbers."""
from __future__ import annotations

import pytest

from conftest import SMOKE, maths_only, read_metrics, run_program, run_smoke
from htfl_dist.runtime.simulate import simulate

ASYNC = ["participation.mode=async", "participation.clock=true", "participation.concurrency=3",
         "participation.buffer=2"]


@pytest.mark.integration
def test_each_row_is_one_server_step_of_k_uploads(tmp_path, cache_dir):
    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *ASYNC, "rounds=4"], out=tmp_path / "run")
    assert [r["server_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["arrived_clients"] == 2 and sum(r["staleness_histogram"]) == 2 for r in rows)
    assert rows[0]["staleness_histogram"] == [2]  # the first step: everyone started from version 0
    assert any(r["staleness_max"] > 0 for r in rows)  # later arrivals trained on older knowledge
    clock = [r["sim_clock_s"] for r in rows]
    assert clock == sorted(clock) and clock[0] > 0
    assert [round(b - a, 6) for a, b in zip([0.0, *clock], clock, strict=False)] == [r["sim_round_s"] for r in rows]
    assert rows[-1]["test_acc"] > rows[0]["test_acc"]


@pytest.mark.integration
def test_stale_uploads_are_dropped_and_counted(tmp_path, cache_dir, capsys):
    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *ASYNC, "participation.max_staleness=0", "rounds=4"],
                    out=tmp_path / "run")
    assert all(r["staleness_max"] == 0 and r["arrived_clients"] == 2 for r in rows)
    dropped = [c for r in rows for c in r["stale_dropped_clients"]]
    assert dropped, "some upload of a 3-in-flight, 2-per-step run is a step stale"
    assert "participation.max_staleness=0 server steps stale; dropped" in capsys.readouterr().err


@pytest.mark.integration
def test_fedtgp_trains_on_the_fresh_uploads_of_the_buffer(tmp_path, cache_dir):
    """FedTGP's server trains on every (client, class) pair it received: those of the step's
    arrivals that were not too stale."""
    import numpy as np

    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition

    overrides = [f"data.cache_dir={cache_dir}", *ASYNC, "algorithm=fedtgp", "algo.server_epochs=2",
                 "participation.max_staleness=0", "rounds=3"]
    rows = simulate(SMOKE, overrides, out=tmp_path / "run")
    counts = prepare_partition(load_config(SMOKE, overrides).data, 6, 0).class_counts
    assert any(r["stale_dropped_clients"] for r in rows)
    for row in rows:
        assert row["server_pairs"] == int(np.count_nonzero(counts[row["aggregated_clients"]]))


@pytest.mark.integration
def test_lgfedavg_takes_fedbuff_steps_on_its_head(tmp_path, cache_dir):
    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", *ASYNC, "algorithm=lgfedavg",
                            "participation.server_rate=0.5", "rounds=3"], out=tmp_path / "run")
    assert all(r["head_uploads"] == 2 and r["head_change"] > 0 for r in rows)
    assert any(r["staleness_max"] > 0 for r in rows)


@pytest.mark.integration
def test_each_arrival_trains_with_the_version_it_started_from(tmp_path, cache_dir, monkeypatch):
    from htfl_dist.runtime import asynchronous
    from htfl_dist.runtime.asynchronous import AsynchronousSteps
    from htfl_dist.runtime.local_training import LocalTraining

    plans, trained, stepped = [], [], []
    plan, train, step = AsynchronousSteps.step_starts, LocalTraining.train, asynchronous.server_step

    def planned(self, knowledge):
        starts = plan(self, knowledge)
        plans.append((starts, {k: v.clone() for k, v in knowledge.items()}))
        return starts

    def training(self, trainers, knowledge, round_index):
        trained.append((round_index, sorted(trainers), {k: v.clone() for k, v in knowledge.items()}))
        return train(self, trainers, knowledge, round_index)

    def stepping(server, uploads, weights, started, rate, round_index, generator):
        stepped.append((round_index, started))
        return step(server, uploads, weights, started, rate, round_index, generator)

    monkeypatch.setattr(AsynchronousSteps, "step_starts", planned)
    monkeypatch.setattr(asynchronous, "server_step", stepping)
    monkeypatch.setattr(LocalTraining, "train", training)
    simulate(SMOKE, [f"data.cache_dir={cache_dir}", *ASYNC, "rounds=4"], out=tmp_path / "run")
    older = 0
    for round_index, clients, knowledge in trained:
        starts = plans[round_index][0]
        (version,) = {starts[c] for c in clients}  # one call per start version
        expected = plans[version][1]
        assert knowledge.keys() == expected.keys() and all(knowledge[k].equal(expected[k]) for k in knowledge)
        older += version < round_index
    assert older > 0
    assert [r for r, _ in stepped] == [0, 1, 2, 3]
    for round_index, started in stepped:  # the server's w_v of each upload: the knowledge it trained with
        for client, knowledge in started.items():
            expected = plans[plans[round_index][0][client]][1]
            assert all(knowledge[k].equal(expected[k]) for k in expected)
    assert sorted(c for r, clients, _ in trained for c in clients) == sorted(c for s, _ in plans for c in s)


@pytest.mark.integration
def test_resume_continues_the_same_steps(tmp_path, cache_dir):
    overrides = [f"data.cache_dir={cache_dir}", *ASYNC, "checkpoint_every=1"]
    whole = simulate(SMOKE, [*overrides, "rounds=5"], out=tmp_path / "whole")
    out = tmp_path / "resumed"
    first = run_program(["--config", str(SMOKE), "--out", str(out), *overrides, "rounds=2"])
    assert first.returncode == 0, first.stderr
    second = run_program(["--config", str(SMOKE), "--out", str(out), "--resume", "auto", *overrides, "rounds=5"])
    assert second.returncode == 0, second.stderr
    assert maths_only(read_metrics(out)) == maths_only(whole)


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_one_process_and_three_ranks_agree(tmp_path, cache_dir, launcher):
    overrides = [*ASYNC, "participation.jitter=0.3", "rounds=4"]
    single = run_smoke("single", 1, tmp_path / "one", cache_dir, *overrides)
    spread = run_smoke(launcher, 3, tmp_path / "three", cache_dir, *overrides)
    assert maths_only(spread) == maths_only(single)
    assert any(r["staleness_max"] > 0 for r in single)
