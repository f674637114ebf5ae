"""Realistic federations (participation.*) in whole runs: who reaches the server under drop-out,
a deadline on the simulated clock and random participation; the clock's rows; the same numbers
on any world size and after a resume; nothing of it when the section is left at its defaults."""
from __future__ import annotations

import json

import pytest

from conftest import SMOKE, maths_only, read_metrics, run_program, run_smoke
from htfl_dist.config import load_config
from htfl_dist.errors import NothingAggregated
from htfl_dist.runtime.simulate import simulate

FAST, SLOW = 1000.0, 1e-4
"""Speeds in a trace: a FAST client's round takes microseconds, a SLOW one's hours."""
SPEEDS = [FAST, SLOW, FAST, SLOW, FAST, FAST]


def _trace(directory, speeds=SPEEDS) -> str:
    path = directory / "trace.csv"
    path.write_text("client,speed,bandwidth_mbps\n" + "".join(f"{c},{s},1000\n" for c, s in enumerate(speeds)))
    return str(path)


def _deadline_overrides(trace: str, cache_dir) -> list[str]:
    return [f"data.cache_dir={cache_dir}", "participation.clock=true", "participation.profile=trace",
            f"participation.trace={trace}", "participation.deadline_s=10", "participation.jitter=0.2"]


@pytest.mark.integration
def test_the_deadline_keeps_the_fast_clients_and_the_clock_adds_up(tmp_path, cache_dir):
    rows = simulate(SMOKE, _deadline_overrides(_trace(tmp_path), cache_dir), out=tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["late_clients"] == [1, 3]  # speed 1e-4: hours of simulated training
        assert row["dropped_clients"] == [] and row["arrived_clients"] == 4
        assert row["sim_round_s"] == 10.0  # someone was late: the server waited to the deadline
    assert [r["sim_clock_s"] for r in rows] == [10.0, 20.0, 30.0]
    from htfl_dist.metrics.report import ReportError
    from htfl_dist.report import run as report

    assert report([str(tmp_path / "run"), "--plot", str(tmp_path / "t.png"), "--x", "sim_clock_s"]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    with pytest.raises(ReportError, match="unknown metric 'sim_clock'"):
        report([str(tmp_path / "run"), "--plot", str(tmp_path / "u.png"), "--x", "sim_clock"])


@pytest.mark.integration
def test_only_the_arrived_uploads_reach_the_server(tmp_path, cache_dir):
    """FedTGP's server trains on every (client, class) pair it received: exactly the pairs of the
    clients that neither dropped out nor missed the deadline."""
    import numpy as np

    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition

    overrides = [*_deadline_overrides(_trace(tmp_path), cache_dir), "algorithm=fedtgp", "algo.server_epochs=2",
                 "participation.drop_rate=0.2", "rounds=2"]
    rows = simulate(SMOKE, overrides, out=tmp_path / "run")
    counts = prepare_partition(load_config(SMOKE, overrides).data, 6, 0).class_counts
    for row in rows:
        assert len(row["dropped_clients"]) == 2  # int(0.8 · 6) = 4 arrive or are late
        arrived = sorted(set(range(6)) - set(row["dropped_clients"]) - set(row["late_clients"]))
        assert row["arrived_clients"] == len(arrived) and set(row["late_clients"]) <= {1, 3}
        assert row["server_pairs"] == int(np.count_nonzero(counts[arrived]))


@pytest.mark.integration
def test_late_uploads_join_the_next_round_when_asked(tmp_path, cache_dir):
    """participation.late=next_round: clients 1 and 3 miss every deadline; from round 2 on their
    previous round's prototypes are among the pairs FedTGP's server trains on, and round 1, which
    has none to fold, is the late=drop run's round 1."""
    import numpy as np

    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition

    overrides = [*_deadline_overrides(_trace(tmp_path), cache_dir), "algorithm=fedtgp", "algo.server_epochs=2"]
    late = simulate(SMOKE, [*overrides, "participation.late=next_round"], out=tmp_path / "late")
    dropped = simulate(SMOKE, overrides, out=tmp_path / "drop")
    counts = prepare_partition(load_config(SMOKE, overrides).data, 6, 0).class_counts
    on_time = [0, 2, 4, 5]
    assert [r["late_folded_clients"] for r in late] == [[], [1, 3], [1, 3]]
    assert [r["server_pairs"] for r in late] == [int(np.count_nonzero(counts[on_time])),
                                                 *[int(np.count_nonzero(counts))] * 2]
    assert all(r["server_pairs"] == int(np.count_nonzero(counts[on_time])) for r in dropped)
    assert "late_folded_clients" not in dropped[0]
    assert late[0]["test_acc"] == dropped[0]["test_acc"] and late[1]["test_acc"] != dropped[1]["test_acc"]
    resumed = tmp_path / "resumed"
    common = ["--config", str(SMOKE), "--out", str(resumed), *overrides, "participation.late=next_round",
              "checkpoint_every=1"]
    assert run_program([*common, "rounds=2"]).returncode == 0
    assert run_program([*common, "--resume", "auto", "rounds=3"]).returncode == 0
    assert maths_only(read_metrics(resumed)) == maths_only(late)  # the held uploads survive the checkpoint


@pytest.mark.integration
def test_clients_outside_their_windows_are_not_heard(tmp_path, cache_dir):
    """Clients 1 and 3 miss every 10 s deadline, so rounds start at 0, 10 and 20 simulated s;
    client 0 can take part in [0, 15), client 2 from 10 s on."""
    windows = {0: "0-15", 2: "10-100"}
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps,available\n" + "".join(
        f"{c},{s},1000,{windows.get(c, '')}\n" for c, s in enumerate(SPEEDS)))
    rows = simulate(SMOKE, _deadline_overrides(str(trace), cache_dir), out=tmp_path / "run")
    assert [r["unavailable_clients"] for r in rows] == [[2], [], [0]]
    assert [r["arrived_clients"] for r in rows] == [3, 4, 3]
    assert [r["late_clients"] for r in rows] == [[1, 3]] * 3


@pytest.mark.integration
def test_a_slow_tier_misses_the_deadline(tmp_path, cache_dir):
    """participation.profile=tiers: half the clients a million times slower than the rest are the
    ones late in every round, the same half each round, drawn from the seed."""
    from htfl_dist.runtime.clock import tier_devices

    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", "participation.clock=true", "participation.profile=tiers",
                            "participation.tiers=0.5:1000:1000,0.5:0.0000001:1000", "participation.deadline_s=10"],
                    out=tmp_path / "run")
    slow = [c for c, d in enumerate(tier_devices(0, 6, [(0.5, 1000, 1000), (0.5, 1e-7, 1000)], 0, 0)) if d.speed < 1]
    assert len(slow) == 3 and all(r["late_clients"] == slow and r["arrived_clients"] == 3 for r in rows)


def test_late_uploads_need_a_deadline_and_a_server_that_takes_them(tmp_path, cache_dir):
    out = tmp_path / "run"
    result = run_program(["--config", str(SMOKE), "--out", str(out), *_deadline_overrides(_trace(tmp_path), cache_dir),
                          "algorithm=fedl2g", "participation.late=next_round"])
    assert result.returncode == 2
    assert "participation.late=next_round: fedl2g's server answers each round's uploads" in result.stderr
    assert not (out / "metrics.jsonl").exists()
    from htfl_dist.errors import ConfigError

    with pytest.raises(ConfigError, match=r"without participation\.deadline_s no upload is late"):
        load_config(SMOKE, ["participation.clock=true", "participation.late=next_round"])


@pytest.mark.integration
def test_without_a_deadline_the_round_ends_at_the_last_arrival(tmp_path, cache_dir):
    overrides = [o for o in _deadline_overrides(_trace(tmp_path, [FAST] * 6), cache_dir)
                 if not o.startswith("participation.deadline_s=")]
    rows = simulate(SMOKE, overrides, out=tmp_path / "run")
    assert all(r["late_clients"] == [] and r["arrived_clients"] == 6 for r in rows)
    assert all(0 < r["sim_round_s"] < 1 for r in rows)  # microseconds of compute, ~KB at 1 Gbit/s
    assert len({r["sim_round_s"] for r in rows}) == 3  # jitter and bytes differ per round
    assert rows[-1]["sim_clock_s"] == pytest.approx(sum(r["sim_round_s"] for r in rows), abs=1e-5)


@pytest.mark.integration
def test_drop_out_and_random_join_counts(tmp_path, cache_dir):
    rows = simulate(SMOKE, [f"data.cache_dir={cache_dir}", "rounds=6", "join_ratio=0.5",
                            "participation.random_join=true", "participation.drop_rate=0.5"], out=tmp_path / "run")
    joined = []
    for row in rows:
        n = row["arrived_clients"] + len(row["dropped_clients"])
        joined.append(n)
        assert 3 <= n <= 6  # HtFLlib's -rjr: int(6 · 0.5)..6 take part
        assert row["arrived_clients"] == int(0.5 * n)  # HtFLlib's -cdr: int((1 − rate)·n) arrive
        assert "sim_round_s" not in row  # no clock asked for
    assert len(set(joined)) > 1


@pytest.mark.integration
def test_too_few_arrivals_skip_the_server_step_and_say_so(tmp_path, cache_dir, capsys):
    """Every round is short of participation.min_clients: each says so once, and a run in which no
    round aggregated ends in NothingAggregated after its rows and summary are written."""
    with pytest.raises(NothingAggregated, match=r"no round of this run aggregated an upload \(3 played"):
        simulate(SMOKE, [*_deadline_overrides(_trace(tmp_path), cache_dir), "participation.min_clients=5"],
                 out=tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3 and all(r["server_skipped"] is True and r["arrived_clients"] == 4 for r in rows)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"htfl_dist: warning: round {r}: 4 of 6 uploads arrived, fewer than "
                        f"participation.min_clients=5; the server keeps last round's knowledge" for r in (1, 2, 3)]


@pytest.mark.integration
def test_resume_continues_the_same_clock(tmp_path, cache_dir):
    overrides = [*_deadline_overrides(_trace(tmp_path, [FAST, SLOW, FAST, FAST, FAST, FAST]), cache_dir),
                 "participation.drop_rate=0.2", "participation.deadline_s=0", "checkpoint_every=1"]
    whole = simulate(SMOKE, [*overrides, "rounds=4"], out=tmp_path / "whole")
    out = tmp_path / "resumed"
    first = run_program(["--config", str(SMOKE), "--out", str(out), *overrides, "rounds=2"])
    assert first.returncode == 0, first.stderr
    second = run_program(["--config", str(SMOKE), "--out", str(out), "--resume", "auto", *overrides, "rounds=4"])
    assert second.returncode == 0, second.stderr
    resumed = read_metrics(out)
    assert [r["sim_clock_s"] for r in resumed] == [r["sim_clock_s"] for r in whole]
    assert maths_only(resumed) == maths_only(whole)
    def per_client_rows(run):
        return [json.loads(line) for line in (run / "per_client.jsonl").read_text().splitlines()]

    per_client = per_client_rows(out)
    assert per_client == per_client_rows(tmp_path / "whole")
    assert [r["round"] for r in per_client] == [1, 2, 3, 4]  # the resumed run kept rounds 1-2 once


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_one_process_and_three_ranks_agree(tmp_path, cache_dir, launcher):
    overrides = [*_deadline_overrides(_trace(tmp_path), cache_dir)[1:], "participation.drop_rate=0.25",
                 "participation.random_join=true", "join_ratio=0.5", "participation.send_slow_rate=0.5",
                 "eval.clients_fraction=0.5", "stop.patience=2", "participation.late=next_round"]
    single = run_smoke("single", 1, tmp_path / "one", cache_dir, *overrides)
    spread = run_smoke(launcher, 3, tmp_path / "three", cache_dir, *overrides)
    assert maths_only(spread) == maths_only(single)
    assert [r["sim_clock_s"] for r in spread] == [r["sim_clock_s"] for r in single]


@pytest.mark.integration
def test_left_at_its_defaults_the_section_changes_nothing(single_run):
    _, rows = single_run()
    assert not any(key in row for row in rows for key in ("sim_round_s", "dropped_clients", "late_clients"))


def test_a_bad_trace_is_one_line_before_the_run_starts(tmp_path, cache_dir):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps\n0,1,8\n1,-3,8\n")
    out = tmp_path / "run"
    result = run_program(["--config", str(SMOKE), "--out", str(out), *_deadline_overrides(str(trace), cache_dir)])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"htfl_dist: error: participation.trace {trace}: line 3: speed is -3; it must be a finite "
                     f"number > 0"], result.stderr
    assert not (out / "metrics.jsonl").exists()


def test_a_study_checks_its_cells_as_a_start_does(tmp_path):
    """A study validates each cell with the start's own checks: a cell whose trace is bad is one
    line naming the cell before anything runs."""
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps\n0,1,8\n")  # the smoke config has 6 clients
    study = tmp_path / "study.yaml"
    study.write_text(f"base: {SMOKE}\nset: {{participation.clock: true, participation.profile: trace, "
                     f"participation.trace: {trace}}}\ngrid: {{algorithm: [fedproto]}}\n")
    from htfl_dist.study.plan import StudyError, expand, validate

    with pytest.raises(StudyError, match=r"^cell fedproto(-seed0)?: participation\.trace .*"
                                         r"no entry for client\(s\) \[1, 2, 3, 4, 5\]"):
        validate(expand(study))


@pytest.mark.integration
def test_sampled_evaluation_tests_a_seeded_share_and_everyone_at_the_end(tmp_path, cache_dir):
    """eval.clients_fraction=0.5 of 6 clients: 3 tested on rounds 1-2 (a draw per round), all 6 on
    the last, where the row equals a run that tests everyone (training is untouched)."""
    from htfl_dist.runtime.placement import evaluated_clients

    overrides = [f"data.cache_dir={cache_dir}", "eval.clients_fraction=0.5"]
    rows = simulate(SMOKE, overrides, out=tmp_path / "run")
    assert [r["tested_clients"] for r in rows] == [3, 3, 6]
    full = simulate(SMOKE, [f"data.cache_dir={cache_dir}"], out=tmp_path / "all")
    assert rows[-1]["test_acc"] == full[-1]["test_acc"]  # training is untouched; the last round tests all
    assert "tested_clients" not in full[0]
    draws = [evaluated_clients(0, r, 6, 0.5, last_round=False) for r in range(2)]
    assert all(len(d) == 3 for d in draws) and draws[0] != draws[1]
    assert rows[0]["test_acc"] != full[0]["test_acc"]  # round 1 pooled over 3 clients' samples only
