"""Clients trained side by side (``train.concurrent_clients``, issue 45 item 5): the groups and
the width by hand, threads that really overlap, the global RNG watched (an architecture that
draws trains alone; a draw beside others ends the run naming the clients), the refusals, and
real runs equal to one client at a time. On a GPU (the GPU suite runs this file) the same runs
with recorded steps, each thread on its own stream."""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import SMOKE
from htfl_dist.algorithms import get_algorithm
from htfl_dist.errors import ConfigError, DrewWhileConcurrent
from htfl_dist.runtime.concurrent_training import ConcurrentTraining, WidthTuner
from htfl_dist.runtime.session import checked_config
from htfl_dist.runtime.simulate import simulate
from htfl_dist.runtime.startup import concurrent_clients

CPU = torch.device("cpu")
ROW_KEYS = ("round", "test_acc", "test_acc_head", "train_loss", "bytes_up", "bytes_down")


def training(asked: int = 3, cap: int = 8, architectures: dict[int, str] | None = None) -> ConcurrentTraining:
    """Clients 0..9 of architecture 'A' unless ``architectures`` says otherwise."""
    return ConcurrentTraining(asked, cap, CPU, lambda client_id: (architectures or {}).get(client_id, "A"))


# --------------------------------------------------------------------------- the width


def observe(tuner: WidthTuner, width: int, *rates: float) -> None:
    """A warm-up group (1 sample/s: left out, or it would decide) and then groups at ``rates``."""
    for rate in (1.0, *rates):
        tuner.observe(width, samples=rate, seconds=1.0)


def test_auto_widens_while_each_width_trains_ten_percent_more_samples_a_second():
    tuner = WidthTuner(0, cap=8)
    for width, rates in [(1, (100, 90, 110)), (2, (150, 160, 990)), (4, (200, 200, 10)), (8, (210, 230, 215))]:
        assert tuner.width() == width
        observe(tuner, width, *rates)
    # medians 100, 160 >= 1.1 * 100, 200 >= 1.1 * 160, but 215 < 1.1 * 200: four it is
    assert tuner.settled == 4 and tuner.width() == 4


def test_auto_stays_at_one_when_two_gain_less_than_ten_percent_and_ignores_other_widths():
    tuner = WidthTuner(0, cap=8)
    observe(tuner, 1, 100, 100)
    tuner.observe(2, samples=500, seconds=1.0)  # not the width being tried: a round's last, smaller group
    tuner.observe(1, samples=100, seconds=1.0)
    assert tuner.width() == 2
    observe(tuner, 2, 105, 109, 500)  # median 109 < 110
    assert tuner.settled == 1


def test_the_first_group_at_each_width_is_left_out_of_its_measure():
    tuner = WidthTuner(0, cap=8)
    for rate in (100, 100, 100, 100):
        tuner.observe(1, samples=rate, seconds=1.0)
    for rate in (5, 120, 500, 500):  # a slow first group (recording, new threads): counted, it would decide
        tuner.observe(2, samples=rate, seconds=1.0)
    assert tuner.best == (2, 500) and tuner.width() == 4


def test_auto_stops_at_the_cap_and_a_fixed_width_is_capped():
    tuner = WidthTuner(0, cap=3)
    for width in (1, 2):
        observe(tuner, width, *[100.0 * width] * 3)
    assert tuner.settled == 2  # 4 is past the cap: the best tried
    assert WidthTuner(4, cap=2).width() == 2
    assert WidthTuner(3, cap=8).width() == 3


def test_a_round_without_a_group_as_wide_as_the_width_tried_ends_the_trial():
    tuner = WidthTuner(0, cap=8)
    observe(tuner, 1, 100, 100, 100)
    observe(tuner, 2, 300, 300, 300)
    assert tuner.width() == 4
    tuner.round_over()  # round with groups of 4 in it: nothing decided yet
    assert tuner.settled is None
    tuner.observe(4, samples=1, seconds=1.0)
    tuner.round_over()  # a round with a group of 4 (its warm-up): still trying
    assert tuner.settled is None
    tuner.observe(3, samples=900, seconds=1.0)  # three clients a round on this rank from now on
    tuner.round_over()
    assert tuner.settled == 2


# --------------------------------------------------------------------------- groups and threads


def test_an_architectures_first_client_trains_alone_then_its_clients_go_by_the_width():
    concurrent = training(3, architectures={2: "B", 3: "B"})
    pending = [0, 1, 2, 3, 4, 5, 6, 7]
    assert concurrent.next_group(pending) == [0]  # A not yet known
    concurrent.draws["A"] = False
    assert concurrent.next_group(pending) == [1]  # B next in line is unknown: A's group stops before it
    assert concurrent.next_group(pending) == [2]  # B unknown: alone
    concurrent.draws["B"] = True
    assert concurrent.next_group(pending) == [3]  # B draws: always alone
    assert concurrent.next_group(pending) == [4, 5, 6]
    assert pending == [7]
    unknown_first = training(3, architectures={0: "C"})
    unknown_first.draws["A"] = False
    assert unknown_first.next_group([0, 1, 2]) == [0]  # C unknown: alone, even before clients that are known


def test_a_group_trains_in_threads_at_once_and_comes_back_in_client_order():
    concurrent = training(3)
    concurrent.draws["A"] = False
    met = threading.Barrier(3, timeout=20)  # broken, and the test failed, unless three run at once
    threads: dict[int, str] = {}

    def train_one(client_id: int) -> int:
        threads[client_id] = threading.current_thread().name
        met.wait()
        return 10 * client_id

    seeded: list[int] = []
    outcomes = concurrent.train([4, 5, 6], seeded.append, train_one, lambda outcome: 1, round_index=0)
    assert outcomes == [40, 50, 60]
    assert len(set(threads.values())) == 3 and threading.current_thread().name not in threads.values()
    assert seeded == [6]  # the global RNG left as one at a time leaves it: seeded for the last client


def test_the_first_client_is_watched_and_an_architecture_that_draws_trains_alone(capsys):
    concurrent = training(3, architectures={1: "B"})
    seeded: list[int] = []

    def seed_for(client_id: int) -> None:  # as seed_training does: the watch starts after it
        seeded.append(client_id)
        torch.manual_seed(client_id)

    def draws_if_b(client_id: int) -> int:
        if client_id == 1:
            torch.rand(1)  # dropout's kind of draw: torch's global RNG
        return client_id

    assert concurrent.train([0], seed_for, draws_if_b, lambda outcome: 1, round_index=0) == [0]
    assert concurrent.train([1], seed_for, draws_if_b, lambda outcome: 1, round_index=0) == [1]
    assert seeded == [0, 1]  # seeded before training alone, as one at a time is
    assert concurrent.draws == {"A": False, "B": True}
    assert "B's training draws from torch's global RNG" in capsys.readouterr().err


def test_a_draw_beside_others_ends_the_run_naming_the_clients_and_the_round():
    concurrent = training(2)
    concurrent.draws["A"] = False

    def draws_on_client_8(client_id: int) -> int:
        if client_id == 8:
            torch.randn(3)
        return client_id

    with pytest.raises(DrewWhileConcurrent, match=r"^clients \[7, 8\] drew from torch's global RNG .* in round 3"):
        concurrent.train([7, 8], lambda client_id: None, draws_on_client_8, lambda outcome: 1, round_index=2)


def test_a_failing_client_is_raised_after_every_thread_of_its_group_finished():
    concurrent = training(2)
    concurrent.draws["A"] = False
    finished: list[int] = []
    other_started = threading.Event()

    def train_one(client_id: int) -> int:
        if client_id == 0:
            other_started.wait(timeout=20)
            raise ValueError("client 0 broke")
        other_started.set()
        threading.Event().wait(0.2)
        finished.append(client_id)
        return client_id

    with pytest.raises(ValueError, match="client 0 broke"):
        concurrent.train([0, 1], lambda client_id: None, train_one, lambda outcome: 1, round_index=0)
    assert finished == [1]


# --------------------------------------------------------------------------- what it runs with


def test_auto_is_one_at_a_time_on_a_cpu_and_an_explicit_width_is_kept():
    entry = get_algorithm("fedproto")
    width, why = concurrent_clients(checked_config(str(SMOKE), ["train.concurrent_clients=0"]), entry, CPU)
    assert (width, why) == (1, "the device is cpu: a rank's threads serve one client at a time (run more ranks)")
    assert concurrent_clients(checked_config(str(SMOKE), ["train.concurrent_clients=3"]), entry, CPU) == (3, "")
    assert concurrent_clients(checked_config(str(SMOKE), ["train.concurrent_clients=0"]), entry,
                              torch.device("cuda")) == (0, "")


@pytest.mark.parametrize(("overrides", "message"), [
    (("algorithm=fedoc",), r"^train.concurrent_clients=2 cannot train clients side by side: fedoc's client step is "
                           r"not declared trains_concurrently \(these are: fedproto, fedtgp, local, protonorm\)"),
    (("privacy.enabled=true",), r"^train.concurrent_clients=2 cannot train clients side by side: privacy.enabled"),
])
def test_what_cannot_train_side_by_side_is_refused_in_one_line(overrides, message):
    config = checked_config(str(SMOKE), ["train.concurrent_clients=2", *overrides])
    with pytest.raises(ConfigError, match=message):
        concurrent_clients(config, get_algorithm(config.algorithm), CPU)


@pytest.mark.parametrize("other", ["train.compile=default", "train.client_batching=vmap"])
def test_compile_and_batched_clients_are_refused_beside_it(other):
    with pytest.raises(ConfigError, match=r"^train.concurrent_clients=2 trains clients side by side in threads; "):
        checked_config(str(SMOKE), ["train.concurrent_clients=2", other])


def test_auto_settles_on_one_where_an_explicit_width_is_refused():
    config = checked_config(str(SMOKE), ["train.concurrent_clients=0", "algorithm=fedoc"])
    width, why = concurrent_clients(config, get_algorithm("fedoc"), torch.device("cuda"))
    assert width == 1 and "fedoc's client step is not declared trains_concurrently" in why


def test_a_subclass_that_changes_a_method_does_not_inherit_the_claim():
    from htfl_dist.algorithms.fedproto import PrototypeClient
    from htfl_dist.algorithms.registry import vouched_concurrent

    class KeepsState(PrototypeClient):
        def train(self, client, knowledge, round_index, generator):  # e.g. writes self.last_client
            return super().train(client, knowledge, round_index, generator)

    class VouchesAgain(KeepsState):
        trains_concurrently = True

    class ChangesNothing(PrototypeClient):
        pass

    assert vouched_concurrent(PrototypeClient) and vouched_concurrent(get_algorithm("fedproto").client)
    assert not vouched_concurrent(KeepsState)
    assert vouched_concurrent(VouchesAgain) and vouched_concurrent(ChangesNothing)
    assert not vouched_concurrent(get_algorithm("fedoc").client)  # a loss of its own below the claim


# --------------------------------------------------------------------------- real runs


def devices() -> list[str]:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: the GPU suite runs it (streams, recorded steps)"))]


@pytest.mark.integration
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("algorithm", "extra"), [
    ("fedproto", ()),
    ("protonorm", ()),  # FedProto's client with ProtoNorm's options: the claim carries over, no method is changed
    # a group no larger than the store holds; the round's learning rate set for a group too
    ("local", ("runtime.resident_clients=2", "train.lr_schedule=exponential", "train.lr_decay=0.5")),
])
def test_clients_side_by_side_give_the_rows_of_one_at_a_time(algorithm, extra, device, tmp_path, cache_dir,
                                                                 monkeypatch):
    """Round 1 trains each architecture's first client alone (6 clients, 8 architectures), later
    rounds three at a time (two with two resident clients); every row equals one at a time's, bit
    for bit."""
    overrides = [f"data.cache_dir={cache_dir}", "rounds=3", f"algorithm={algorithm}", *extra]
    if device == "cuda":  # recorded steps too: on (a recording that fails raises) where declared capturable
        overrides.append("train.cuda_graphs=" + ("on" if get_algorithm(algorithm).client.capturable_step else "auto"))
    alone = simulate(SMOKE, overrides, out=tmp_path / "alone", device=device)
    groups = []
    together_one = ConcurrentTraining._together

    def counted(self, client_ids, train_one, round_index):
        groups.append((round_index, len(client_ids)))
        return together_one(self, client_ids, train_one, round_index)

    monkeypatch.setattr(ConcurrentTraining, "_together", counted)
    together = simulate(SMOKE, [*overrides, "train.concurrent_clients=3"], out=tmp_path / "together", device=device)
    assert [[row[key] for key in ROW_KEYS] for row in together] == [[row[key] for key in ROW_KEYS] for row in alone]
    width = 2 if "runtime.resident_clients=2" in extra else 3
    assert groups == [(round_index, width) for round_index in (1, 2) for _ in range(6 // width)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the GPU suite runs it")
def test_each_thread_trains_and_records_on_streams_no_other_thread_uses():
    """``torch.cuda.Stream()`` hands out pooled streams in turn: a stream asked for per call would
    in time be another thread's. Each training thread's stream and each thread's side stream
    (warm-up, recording) are made once and are distinct, and none is the main thread's."""
    from htfl_dist.algorithms.step_graphs import CudaGraphs

    device = torch.device("cuda")
    concurrent = ConcurrentTraining(4, 4, device, lambda client_id: "A")
    concurrent.draws["A"] = False
    seen: dict[int, tuple[int, int]] = {}
    met = threading.Barrier(4, timeout=60)

    def streams_of(client_id: int) -> int:
        for _ in range(40):  # many warm-ups and clients: a stream made per call would come round again
            side = CudaGraphs.side_stream()
        seen[client_id] = (torch.cuda.current_stream().cuda_stream, side.cuda_stream)
        met.wait()
        return client_id

    for round_index in range(3):
        concurrent.train([0, 1, 2, 3], lambda client_id: None, streams_of, lambda outcome: 1, round_index)
    handles = [handle for pair in seen.values() for handle in pair]
    assert len(set(handles)) == 8
    assert torch.cuda.current_stream().cuda_stream not in handles
    assert CudaGraphs.side_stream().cuda_stream not in handles
    concurrent.close()
