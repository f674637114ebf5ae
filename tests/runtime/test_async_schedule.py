"""Buffered asynchronous aggregation (runtime.asynchronous) worked by hand: the schedule of a
4-client federation with C=3 in flight and K=2 per step, one server step's class means, the
staleness weights, and the refusals of what async cannot run with."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import make_context

from conftest import SMOKE
from htfl_dist.config import load_config
from htfl_dist.errors import ConfigError
from htfl_dist.runtime.asynchronous import (
    Arrival,
    BufferedSchedule,
    check_asynchronous,
    mix_class_rows,
    server_step,
    staleness_weight,
)

SECONDS = {0: 3.0, 1: 5.0, 2: 4.0, 3: 1.0, 4: 2.0}
"""Each client's simulated seconds, whatever its start or version."""


def lowest_idle(index, idle):
    return min(idle)


def schedule(num_clients=4, concurrency=3, buffer=2, max_staleness=None, asked=None):
    def seconds(client, count, version):
        if asked is not None:
            asked.append((client, count, version))
        return SECONDS[client]

    return BufferedSchedule(0, num_clients, concurrency, buffer, max_staleness, seconds, draw=lowest_idle)


def test_four_clients_three_in_flight_two_per_step():
    """t=0: 0, 1, 2 start from v0 (finishing at 3, 5, 4). Step 0: 0 arrives at 3 and 3 starts in
    its place (v0, done at 4); 2 and 3 tie at 4, 2 first: the K-th, the step ends at 4; 0 starts
    from v1 (done at 7). Step 1: 3 (v0, τ=1) at 4, 2 starts from v1 (done at 8); 1 (v0, τ=1) at
    5; 1 starts from v2 (done at 10). Step 2: 0 (v1, τ=1) at 7, 3 starts from v2 (done at 8);
    2 (v1, τ=1) at 8; 0 starts from v3. Step 3: 3 (v2, τ=1) at 8; 1 (v2, τ=1) at 10."""
    asked = []
    plans = [s.plan_step() for s in [schedule(asked=asked)] for _ in range(4)]
    assert [p.arrivals for p in plans] == [
        (Arrival(0, 0, 0, 3.0, False), Arrival(2, 0, 0, 4.0, False)),
        (Arrival(3, 0, 1, 4.0, False), Arrival(1, 0, 1, 5.0, False)),
        (Arrival(0, 1, 1, 7.0, False), Arrival(2, 1, 1, 8.0, False)),
        (Arrival(3, 2, 1, 8.0, False), Arrival(1, 2, 1, 10.0, False)),
    ]
    assert [(p.version, p.began_s, p.ended_s) for p in plans] == [(0, 0.0, 4.0), (1, 4.0, 5.0), (2, 5.0, 8.0),
                                                                  (3, 8.0, 10.0)]
    assert plans[1].starts() == {3: 0, 1: 0}
    # every start's seconds asked once, with its client's count and its version
    assert sorted(asked) == sorted([(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (0, 1, 1), (2, 1, 1), (1, 1, 2),
                                    (3, 1, 2), (0, 2, 3), (2, 2, 3)])


def test_the_row_of_a_step():
    s = schedule()
    s.plan_step()
    row = s.plan_step().row()
    assert row == {"arrived_clients": 2, "aggregated_clients": [1, 3], "stale_dropped_clients": [], "server_version": 2,
                   "staleness_histogram": [0, 2], "staleness_max": 1, "staleness_mean": 1.0,
                   "sim_round_s": 1.0, "sim_clock_s": 5.0}


def test_stale_uploads_are_dropped_and_the_step_waits_for_fresh_ones():
    """max_staleness=0, step 1: 3 (τ=1) at 4 is dropped, 2 starts from v1 (done at 8); 1 (τ=1) at
    5 is dropped, nobody idle to start; 0 (v1) at 7, 2 (v1) at 8: the two fresh uploads."""
    s = schedule(max_staleness=0)
    s.plan_step()
    plan = s.plan_step()
    assert plan.arrivals == (Arrival(3, 0, 1, 4.0, True), Arrival(1, 0, 1, 5.0, True),
                             Arrival(0, 1, 0, 7.0, False), Arrival(2, 1, 0, 8.0, False))
    assert plan.row()["stale_dropped_clients"] == [1, 3] and plan.row()["arrived_clients"] == 2
    assert plan.row()["staleness_histogram"] == [2]


def test_the_kth_arrivals_replacement_starts_from_the_new_version():
    """Five clients: at step 0's K-th arrival (2, at 4) clients 4 is idle, but the replacement
    starts after the step, from v1: the lowest idle then is 0 (its upload has been applied)."""
    s = schedule(num_clients=5)
    s.plan_step()
    assert sorted((e.client, e.version, e.started_s) for e in s.in_flight) == [(0, 1, 4.0), (1, 0, 0.0),
                                                                               (3, 0, 3.0)]


def test_a_step_closes_early_when_nobody_is_left_in_flight():
    """Two clients, both in flight, K=3: an arrival waits in the buffer and cannot start again."""
    s = schedule(num_clients=2, concurrency=2, buffer=3)
    plan = s.plan_step()
    assert [a.client for a in plan.arrivals] == [0, 1] and plan.ended_s == 5.0
    assert sorted((e.client, e.version, e.started_s) for e in s.in_flight) == [(0, 1, 5.0), (1, 1, 5.0)]


def test_the_state_round_trips_and_continues_the_same_steps():
    whole = schedule()
    steps = [whole.plan_step() for _ in range(4)]
    first = schedule()
    first.plan_step(), first.plan_step()
    resumed = schedule()
    resumed.load_state_dict(first.state_dict())
    assert [resumed.plan_step(), resumed.plan_step()] == steps[2:]


def test_the_default_draw_is_seeded():
    def run(seed):
        s = BufferedSchedule(seed, 20, 5, 3, None, lambda c, n, v: 1.0 + c)
        return [p.arrivals for p in (s.plan_step(), s.plan_step())]

    assert run(0) == run(0) and run(0) != run(1)


def test_staleness_weights():
    assert staleness_weight(0, "inverse_sqrt", 0.5) == 1.0
    assert staleness_weight(1, "inverse_sqrt", 0.5) == pytest.approx(1 / math.sqrt(2))
    assert staleness_weight(3, "polynomial", 1.0) == 0.25
    assert staleness_weight(7, "constant", 0.5) == 1.0


def test_one_server_step_by_hand():
    """Global rows: class 0 [1, 1], class 2 [4, 0]. Buffer: client 0 (τ=0, s=1) class 0 [3, 1] and
    class 1 [2, 2]; client 1 (τ=1, s=1/√2) class 0 [0, 5]. Class 0's buffer mean
    ([3, 1] + [0, 5]/√2)/(1 + 1/√2) = [1.757359, 2.656854]; with η=½ the row is
    [1.378680, 1.828427]; class 1 is new ([2, 2]); class 2 keeps [4, 0]."""
    entry, context = make_context("fedproto", num_classes=3, feature_dim=2)
    server = entry.server(context)
    server.class_ids, server.rows = torch.tensor([0, 2]), torch.tensor([[1.0, 1.0], [4.0, 0.0]])
    uploads = {0: {"class_ids": torch.tensor([0, 1]), "protos": torch.tensor([[3.0, 1.0], [2.0, 2.0]])},
               1: {"class_ids": torch.tensor([0]), "protos": torch.tensor([[0.0, 5.0]])}}
    server_step(server, uploads, {0: 1.0, 1: 1 / math.sqrt(2)}, {}, 0.5, 0, torch.Generator())
    assert server.class_ids.tolist() == [0, 1, 2]
    expected = torch.tensor([[1.378680, 1.828427], [2.0, 2.0], [4.0, 0.0]])
    assert torch.allclose(server.rows, expected, atol=1e-6)


def test_rate_one_takes_the_buffer_and_an_empty_table_takes_it_whole():
    previous = {"class_ids": torch.tensor([0]), "protos": torch.tensor([[1.0, 1.0]])}
    buffered = {"class_ids": torch.tensor([0]), "protos": torch.tensor([[3.0, 5.0]])}
    assert mix_class_rows(previous, buffered, "protos", 1.0)[1].tolist() == [[3.0, 5.0]]
    empty = {"class_ids": torch.empty(0, dtype=torch.int64), "protos": torch.empty(0, 2)}
    ids, rows = mix_class_rows(empty, buffered, "protos", 0.25)
    assert ids.tolist() == [0] and rows.tolist() == [[3.0, 5.0]]


@pytest.mark.parametrize("average,expected", [("uniform", 1.146447), ("sample_weighted", 0.719670)])
def test_one_fedbuff_step_of_an_averaged_part_by_hand(average, expected):
    """LG-FedAvg's head, every entry alike: w = 1; client 0 (τ=0, s=1, n=10) started from w=1 and
    sends 3; client 1 (τ=1, s=1/√2, n=30) started from w=2 and sends 0; η=½. Uniform:
    Δ = (2 − 2/√2)/2 = 0.292893, w = 1.146447 (FLSim's sum without /K: 1.292893). By samples:
    Δ = (10·2 − 30·2/√2)/40 = −0.560660, w = 0.719670."""
    entry, context = make_context("lgfedavg", head_avg=average)
    server = entry.server(context)
    ones = torch.ones_like(server.row)
    server.set_row(ones)
    uploads = {0: {"head": 3 * ones, "num_samples": torch.tensor([10])},
               1: {"head": 0 * ones, "num_samples": torch.tensor([30])}}
    started = {0: {"head": ones}, 1: {"head": 2 * ones}}
    server_step(server, uploads, {0: 1.0, 1: 1 / math.sqrt(2)}, started, 0.5, 0, torch.Generator())
    assert torch.allclose(server.row, expected * ones, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["fedtgp", "fedpcl"])  # fedpcl: a class-mean server with its own update
def test_another_server_runs_its_own_update_on_the_buffer(algorithm, monkeypatch):
    entry, context = make_context(algorithm)
    server = entry.server(context)
    monkeypatch.setattr(server, "update", lambda uploads, round_index, generator: {"got": sorted(uploads)})
    assert server_step(server, {4: {}, 2: {}}, {4: 0.5, 2: 1.0}, {}, 0.5, 0, torch.Generator()) == {"got": [2, 4]}


ASYNC = ["participation.mode=async", "participation.clock=true"]


@pytest.mark.parametrize("overrides,message", [
    (["participation.mode=async"], "config key 'participation.mode' is async, which runs on the simulated clock; "
                                   "set participation.clock=true"),
    (["participation.buffer=3"], "config key 'participation.buffer' acts only in buffered asynchronous "
                                 "aggregation; set participation.mode=async or leave it out"),
    ([*ASYNC, "participation.deadline_s=5"], "config key 'participation.deadline_s' is 5.0, which acts on a "
                                             "synchronous round; participation.mode=async has none: leave it out"),
    ([*ASYNC, "participation.drop_rate=0.1"], "config key 'participation.drop_rate' is 0.1"),
    ([*ASYNC, "participation.random_join=true"], "config key 'participation.random_join' is True"),
    ([*ASYNC, "participation.staleness_exponent=0.3"], "config key 'participation.staleness_exponent' is the "
                                                       "exponent of participation.staleness=polynomial"),
    ([*ASYNC, "participation.server_rate=0"], "config key 'participation.server_rate' must be in (0, 1]"),
])
def test_what_the_section_refuses(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(SMOKE, overrides)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides,message", [
    ([*ASYNC, "privacy.secure_aggregation=true"], "config key 'privacy.secure_aggregation' sums a round's uploads"),
    ([*ASYNC, "participation.concurrency=7"], "config key 'participation.concurrency' is 7, more than the 6 clients"),
])
def test_what_async_refuses_across_sections(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_asynchronous(load_config(SMOKE, overrides))
    check_asynchronous(load_config(SMOKE, [*ASYNC, "participation.concurrency=6"]))  # every client at once


def test_a_trace_with_availability_windows_is_refused(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps,available\n" + "".join(f"{c},1,100,0-10\n" for c in range(6)))
    config = load_config(SMOKE, [*ASYNC, "participation.profile=trace", f"participation.trace={trace}"])
    with pytest.raises(ConfigError, match=r"config key 'participation\.trace' gives availability windows"):
        check_asynchronous(config)
    trace.write_text("client,speed,bandwidth_mbps\n" + "".join(f"{c},1,100\n" for c in range(6)))
    check_asynchronous(config)  # without windows, a trace is welcome
