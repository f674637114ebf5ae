"""Placement and participant sampling are pure functions of the config."""
import pytest

from htfl_dist.config import RuntimeConfig
from htfl_dist.errors import ConfigError, HtflError
from htfl_dist.runtime import bootstrap
from htfl_dist.runtime.placement import (
    Placement,
    check_world_size,
    plan_placement,
    round_trainers,
    sample_participants,
)

WORK = [5.0, 100.0, 7.0, 60.0, 50.0, 3.0, 1.0, 40.0, 9.0, 2.0, 30.0]


@pytest.mark.parametrize("policy", ["balanced", "round_robin"])
def test_every_client_hosted_exactly_once(policy):
    for world in (1, 2, 3, 5):
        placement = plan_placement(policy, world, WORK)
        hosted = sorted(c for r in range(world) for c in placement.clients_of(r))
        assert hosted == list(range(11))
        assert all(placement.rank_of(c) == r for r in range(world) for c in placement.clients_of(r))
        if world > 1:
            assert placement.clients_of(0) == []  # rank 0 is the server only


def test_round_robin():
    placement = Placement.round_robin(3, 6)
    assert placement.clients_of(1) == [0, 2, 4] and placement.clients_of(2) == [1, 3, 5]


def test_balanced_is_longest_processing_time_first():
    # 2 client ranks, clients by decreasing work, (load r1, load r2) after each:
    # c1 100 → r1 (100, 0); c3 60 → r2 (100, 60); c4 50 → r2 (100, 110); c7 40 → r1 (140, 110);
    # c10 30 → r2 (140, 140); c8 9 → r1, tie → lower rank (149, 140); c2 7 → r2 (149, 147);
    # c0 5 → r2 (149, 152); c5 3 → r1 (152, 152); c9 2 → r1, tie (154, 152); c6 1 → r2 (154, 153).
    placement = Placement.balanced(3, WORK)
    assert placement.clients_of(1) == [1, 5, 7, 8, 9]
    assert placement.clients_of(2) == [0, 2, 3, 4, 6, 10]
    assert sum(WORK[c] for c in placement.clients_of(1)) == 154
    assert sum(WORK[c] for c in placement.clients_of(2)) == 153
    # round-robin: even ids (5 + 7 + 50 + 1 + 9 + 30 = 102) on rank 1, odd ids (205) on rank 2
    assert sum(WORK[c] for c in Placement.round_robin(3, 11).clients_of(2)) == 205
    assert placement.work_share(1) == pytest.approx(154 / 307)


def test_a_round_moves_the_largest_participant_that_fits_until_the_ranks_are_even():
    """Homes 1,1,1,1,2,3 with work 4,3,3,2,1,1, all taking part: loads 12/1/1. Client 0 (4, the
    largest below the lead 11) goes to rank 2 (the idlest, lower rank first): 8/5/1; client 1 (3,
    largest below 7) to rank 3: 5/5/4; the lead is now 1 and nothing smaller moves."""
    home = Placement(4, (1, 1, 1, 1, 2, 3), (4, 3, 3, 2, 1, 1))
    assert round_trainers([0, 1, 2, 3, 4, 5], home) == {0: 2, 1: 3, 2: 1, 3: 1, 4: 2, 5: 3}
    # equal work, a sample all on rank 1 (even ids): the lowest ids move until 15/15
    even = Placement(3, Placement.round_robin(3, 10).ranks, (5.0,) * 10)
    assert round_trainers([0, 1, 2, 4, 6, 8], even) == {0: 2, 1: 2, 2: 2, 4: 1, 6: 1, 8: 1}
    # a balanced sample stays home; one client rank or world size 1 never moves anyone
    assert round_trainers([0, 1], even) == {0: 1, 1: 2}
    assert round_trainers([0, 2, 4], Placement(2, (1,) * 6, (1.0,) * 6)) == {0: 1, 2: 1, 4: 1}
    assert round_trainers([0, 2], Placement.round_robin(1, 3)) == {0: 0, 2: 0}
    # a client as large as the lead would only swap the loads (and back, forever): it stays
    assert round_trainers([0], Placement(3, (1, 2), (5.0, 5.0))) == {0: 1}
    # no work known: one per client
    assert round_trainers([0, 2, 4, 6], Placement.round_robin(3, 8)) == {0: 2, 2: 2, 4: 1, 6: 1}


def test_placement_lines_name_ranks_clients_and_shares():
    assert Placement.balanced(1, WORK).describe() == "placement: rank 0 is the server and hosts all 11 clients"
    line = plan_placement("round_robin", 3, [5.0, 1.0, 1.0, 1.0, 1.0]).describe()
    assert "rank 1: 3 (0,2,4) 78%" in line and "rank 2: 2 (1,3) 22%" in line
    line = plan_placement("balanced", 3, [5.0, 1.0, 1.0, 1.0, 1.0]).describe()
    assert "rank 1: 1 (0) 56%" in line and "rank 2: 4 (1,2,3,4) 44%" in line
    assert "2 more ranks" in plan_placement("balanced", 11, [1.0] * 20).describe(ranks_shown=8)
    assert Placement.round_robin(3, 6).describe_rank(0) == "rank 0 (server)"
    assert Placement.round_robin(3, 20).describe_rank(1) == "rank 1 (clients [0, 2, 4, 6, 8, 10, 12, 14]...)"


def test_participants_seeded_and_independent_of_world():
    a = sample_participants(0, 3, 20, 0.5)
    assert a == sample_participants(0, 3, 20, 0.5)
    assert len(a) == 10 and a == sorted(set(a))
    assert a != sample_participants(0, 4, 20, 0.5)
    assert sample_participants(0, 0, 20, 1.0) == list(range(20))
    assert len(sample_participants(0, 0, 3, 0.1)) == 1
    for round_index in range(30):  # without replacement, every round: always int(N·ρ) distinct clients
        chosen = sample_participants(1, round_index, 20, 0.5)
        assert len(chosen) == 10 and chosen == sorted(set(chosen))


def test_the_participants_stream_is_pinned():
    """Who takes part is part of what a run computes (a resumed or repeated run must draw the
    same): the (seed, "participants", round) stream is fixed, not an implementation detail."""
    assert sample_participants(1, 0, 20, 0.5) == [0, 3, 8, 9, 10, 12, 13, 15, 16, 18]
    assert sample_participants(1, 1, 20, 0.5) == [1, 2, 4, 5, 9, 10, 12, 13, 15, 17]


def test_client_ranks_are_every_rank_but_the_server_unless_there_is_only_one():
    from htfl_dist.runtime.placement import client_ranks

    assert client_ranks(1) == [0]
    assert client_ranks(2) == [1]
    assert client_ranks(4) == [1, 2, 3]


def test_too_many_ranks_is_a_user_error():
    check_world_size(5, 4)
    with pytest.raises(HtflError, match="at most 5 ranks"):
        check_world_size(6, 4)


# ---------------------------------------------------------------- launcher detection

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE")


def _launch_with(monkeypatch, **env):

    for name in (*_LAUNCH_VARS, *bootstrap.MPI_RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return bootstrap.detect_launch()


def test_a_batch_script_is_not_an_srun_rank(monkeypatch):
    """sbatch -n 4 exports SLURM_PROCID=0 and SLURM_NTASKS=4 to the script itself; a plain run
    there is one process, not rank 0 of 4 waiting for peers that never come."""
    launch = _launch_with(monkeypatch, SLURM_PROCID="0", SLURM_NTASKS="4")
    assert (launch.launcher, launch.rank, launch.world_size) == ("single", 0, 1)


def test_an_srun_step_task_is_a_rank(monkeypatch):
    launch = _launch_with(monkeypatch, SLURM_PROCID="2", SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="3",
                          SLURM_LOCALID="1")
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 2, 3, 1)
    launch = _launch_with(monkeypatch, SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1")
    assert launch.launcher == "single"


def test_torchrun_variables_win(monkeypatch):
    launch = _launch_with(monkeypatch, RANK="1", WORLD_SIZE="3", LOCAL_RANK="1", SLURM_PROCID="0",
                          SLURM_STEP_NUM_TASKS="2")
    assert (launch.launcher, launch.rank, launch.world_size) == ("torchrun", 1, 3)


class _FakeCuda:
    """Two 80 GiB devices, recording what pick_device asks of them."""

    def __init__(self, monkeypatch, available: bool = True) -> None:
        import types

        import torch

        self.calls = []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: available)
        monkeypatch.setattr(cuda, "device_count", lambda: 2 if available else 0)
        monkeypatch.setattr(cuda, "set_device", lambda index: self.calls.append(("set_device", index)))
        monkeypatch.setattr(cuda, "get_device_properties",
                            lambda index: types.SimpleNamespace(total_memory=80 * 2**30))
        monkeypatch.setattr(cuda, "set_per_process_memory_fraction",
                            lambda fraction, index: self.calls.append(("fraction", fraction, index)))


def test_a_gpu_memory_cap_becomes_the_allocators_share_of_the_ranks_device(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    launch = bootstrap.LaunchInfo("torchrun", 3, 4, 3, 4)
    device = bootstrap.pick_device(RuntimeConfig(gpu_memory_gib=20.0), launch)
    assert str(device) == "cuda:1" and fake.calls == [("set_device", 1), ("fraction", 0.25, 1)]  # 20 of 80 GiB
    fake.calls.clear()
    bootstrap.pick_device(RuntimeConfig(gpu_memory_gib=80.0), launch)  # the whole device is allowed
    assert fake.calls == [("set_device", 1), ("fraction", 1.0, 1)]
    fake.calls.clear()
    bootstrap.pick_device(RuntimeConfig(), launch)
    assert fake.calls == [("set_device", 1)]  # 0: no cap
    with pytest.raises(ConfigError, match=r"runtime.gpu_memory_gib=81 but GPU 1 has 80.0 GiB"):
        bootstrap.pick_device(RuntimeConfig(gpu_memory_gib=81.0), launch)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_gpu_memory_cap_on_a_cpu_rank_is_refused(monkeypatch, device):
    _FakeCuda(monkeypatch, available=device == "cpu")  # cpu chosen, or auto finding no GPU
    alone = bootstrap.LaunchInfo("single", 0, 1, 0, 1)
    with pytest.raises(ConfigError, match=r"runtime.gpu_memory_gib=4 caps GPU memory, but this rank computes on "
                                          r"the CPU"):
        bootstrap.pick_device(RuntimeConfig(device=device, gpu_memory_gib=4.0), alone)
    assert str(bootstrap.pick_device(RuntimeConfig(device=device), alone)) == "cpu"


def test_forward_flops_of_fedavgs_cnn_by_hand():
    """FedAvg's CNN on 1×28×28, counted as 2 FLOPs per multiply-add: conv 1→32 (5×5) to 24×24:
    2·25·32·576 = 921,600; pool to 12×12; conv 32→64 (5×5) to 8×8: 2·800·64·64 = 6,553,600;
    pool to 4×4; Linear 1024→512: 1,048,576; head 512→10: 10,240. Total 8,534,016."""
    from htfl_dist.models.cost import forward_flops_per_sample

    flops = forward_flops_per_sample("cnn", num_classes=10, feature_dim=512, in_channels=1, image_size=28)
    assert flops == 921_600 + 6_553_600 + 1_048_576 + 10_240
    assert forward_flops_per_sample("cnn", num_classes=10, feature_dim=512, in_channels=1, image_size=28) == flops
    wider_head = forward_flops_per_sample("cnn", num_classes=100, feature_dim=512, in_channels=1, image_size=28)
    assert wider_head - flops == 2 * 512 * 90


def test_work_by_flops_weighs_samples_by_the_members_cost():
    from htfl_dist.runtime.placement import client_work

    assert client_work([10, 20], ["a", "b"], None) == [10.0, 20.0]
    assert client_work([10, 20, 5], ["a", "b", "a"], {"a": 3.0, "b": 1.0}) == [30.0, 20.0, 15.0]
    # by samples client 1 is the biggest; by FLOPs client 0 is, and balanced placement follows
    by_flops = plan_placement("balanced", 3, client_work([10, 20, 5], ["a", "b", "a"], {"a": 3.0, "b": 1.0}),
                              "FLOPs")
    assert by_flops.clients_of(1) == [0] and by_flops.clients_of(2) == [1, 2]
    assert "(share of FLOPs)" in by_flops.describe()
    with pytest.raises(ValueError):
        client_work([10], ["a", "b"], {"a": 1.0, "b": 1.0})


def _two_member_run(basis: str, *overrides: str):
    """A config of 4 clients alternating cnn and htcnn1, and a partition of 25, 7, 10 and 1 samples."""
    import numpy as np

    from htfl_dist.config import load_config
    from htfl_dist.data import PartitionInfo

    config = load_config(None, ["num_clients=4", "model.group=cnn,htcnn1", f"runtime.placement_work={basis}",
                                "train.batch_size=10", *overrides])
    counts = np.array([[20, 5], [7, 0], [4, 6], [0, 1]])
    return config, PartitionInfo("unused", 2, 1, 28, 4, counts)


def test_estimated_work_of_each_basis_by_hand():
    from htfl_dist.models import members_in_use
    from htfl_dist.models.cost import forward_flops_per_sample
    from htfl_dist.runtime.placement import estimated_client_work

    config, info = _two_member_run("samples")
    assert estimated_client_work(config, info) == ([25.0, 7.0, 10.0, 1.0], "samples")
    assert members_in_use(config.model.group, config.num_clients) == ["cnn", "htcnn1"]
    assert members_in_use("HtCNN8", 3) == ["htcnn1", "htcnn2", "htcnn3"]  # fewer clients than members

    config, info = _two_member_run("flops")
    cnn, htcnn1 = (forward_flops_per_sample(member, num_classes=2, feature_dim=config.model.feature_dim,
                                            in_channels=1, image_size=28) for member in ("cnn", "htcnn1"))
    assert estimated_client_work(config, info) == ([25 * cnn, 7 * htcnn1, 10 * cnn, 1 * htcnn1], "FLOPs")

    # timed: local steps per round x the member's step time. Batch 10, keep: 25 -> 3 steps, 7 -> 1,
    # 10 -> 1, 1 -> 1; two local epochs double them
    config, info = _two_member_run("timed", "train.local_epochs=2")
    step = {"cnn": 0.5, "htcnn1": 2.0}
    assert estimated_client_work(config, info, step) == ([3.0, 4.0, 1.0, 4.0], "timed seconds")
    # drop: 25 -> 2 full batches, 7 -> 0, 10 -> 1, 1 -> 0
    config, info = _two_member_run("timed", "train.last_batch=drop")
    assert estimated_client_work(config, info, step) == ([1.0, 0.0, 0.5, 0.0], "timed seconds")
    with pytest.raises(ValueError, match=r"^placement_work=timed needs the members' measured step times$"):
        estimated_client_work(config, info)


def test_timed_step_leaves_the_global_rng_as_it_was():
    """Rank 0 times steps at start-up: that must not shift any stream a run draws from."""
    import torch

    from htfl_dist.models.cost import timed_step_seconds

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    seconds = timed_step_seconds(["cnn", "htcnn2"], num_classes=10, feature_dim=16, in_channels=1, image_size=28,
                                 batch_size=1, device=torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)
    assert list(seconds) == ["cnn", "htcnn2"] and all(0 < value < 10 for value in seconds.values())


@pytest.mark.parametrize("sent", [[0.01, -1.0], [0.01, float("nan")], [float("inf"), 0.02], [0.0, 0.02]])
def test_step_times_from_rank_0_that_are_not_positive_and_finite_are_refused(sent):
    """A client rank plans its placement from rank 0's broadcast step times: a message carrying a
    negative, zero or NaN time is refused with one line naming rank 0, not used."""
    from types import SimpleNamespace

    import torch

    from htfl_dist.errors import ProtocolError
    from htfl_dist.payload import Field
    from htfl_dist.runtime.startup import timed_step_costs
    from htfl_dist.runtime.wire import BROADCAST_ENTRY, encode

    config, _ = _two_member_run("timed")
    spec = (Field("seconds", torch.float64, (2,), max_rows=1),)
    message = encode(spec, {BROADCAST_ENTRY: {"seconds": torch.tensor([sent], dtype=torch.float64)}})
    client_rank = SimpleNamespace(rank=1, world_size=3, broadcast=lambda _: message)
    with pytest.raises(ProtocolError, match=r"^rank 0 sent step times that are not positive and finite"):
        timed_step_costs(config, None, client_rank, torch.device("cpu"))
    good = encode(spec, {BROADCAST_ENTRY: {"seconds": torch.tensor([[0.01, 0.02]], dtype=torch.float64)}})
    client_rank.broadcast = lambda _: good
    assert timed_step_costs(config, None, client_rank, torch.device("cpu")) == {"cnn": 0.01, "htcnn1": 0.02}


@pytest.mark.parametrize("budget_s,steps_per_member", [(1e9, 1 + 7), (0.0, 1 + 3)])
def test_timing_takes_fewer_passes_once_its_budget_is_spent(monkeypatch, budget_s, steps_per_member):
    """Slow members (ResNet-152: 1.3 s a step on a CPU) must not hold start-up for half a minute:
    one warm-up step, then 7 timed passes, or 3 once the timing has taken its budget."""
    import torch

    from htfl_dist.models import cost

    steps = []
    real_step = cost._sgd_step

    def counted(model, *args):
        step = real_step(model, *args)
        return lambda: (steps.append(type(model)), step())

    monkeypatch.setattr(cost, "_sgd_step", counted)
    monkeypatch.setattr(cost, "TIMED_BUDGET_S", budget_s)
    cost.timed_step_seconds(["cnn", "htcnn2"], num_classes=10, feature_dim=16, in_channels=1, image_size=28,
                            batch_size=2, device=torch.device("cpu"))
    assert len(steps) == 2 * steps_per_member


def test_idle_shares_by_hand():
    """Ranks busy 2.0, 1.0 and 1.5 s wait 0, 1.0 and 0.5 s for the slowest: shares 0, 0.5, 0.25."""
    from htfl_dist.runtime.placement import idle_shares

    assert idle_shares([2.0, 1.0, 1.5]) == [0.0, 0.5, 0.25]
    assert idle_shares([1.0, 3.0]) == [0.6667, 0.0]  # rounded to 4 places, as metrics.jsonl holds them
    assert idle_shares([0.0, 0.0]) == [0.0, 0.0] and idle_shares([]) == []


def test_a_server_that_hosts_clients_is_a_client_rank_too():
    """runtime.server_hosts_clients: W ranks are W client ranks. Balanced over ranks 0 and 1 with
    WORK (by hand, as above but onto r0/r1): c1 100 → r0; c3 60 → r1; c4 50 → r1 (110); c7 40 →
    r0 (140); c10 30 → r1 (140); c8 9 → r0 (149); c2 7 → r1 (147); c0 5 → r1 (152); c5 3 → r0
    (152); c9 2 → r0 (154); c6 1 → r1 (153): the 3-rank split above, moved down one rank."""
    placement = Placement.balanced(2, WORK, server_hosts=True)
    assert placement.clients_of(0) == [1, 5, 7, 8, 9] and placement.clients_of(1) == [0, 2, 3, 4, 6, 10]
    assert Placement.round_robin(2, 5, server_hosts=True).ranks == (0, 1, 0, 1, 0)
    assert plan_placement("round_robin", 3, [1.0] * 4, server_hosts=True).ranks == (0, 1, 2, 0)
    assert Placement.round_robin(2, 4, server_hosts=True).with_unseen(3).unseen == (0, 1, 0)
    assert "rank 0 is the server and hosts clients; clients per rank" in placement.describe()
    assert placement.describe_rank(0) == "rank 0 (clients [1, 5, 7, 8, 9])"
    # two client ranks: a round rebalances between them (not with one client rank)
    home = Placement(2, (0, 0, 0, 1), (4.0, 3.0, 3.0, 1.0), server_hosts=True)
    assert round_trainers([0, 1, 2, 3], home) == {0: 1, 1: 0, 2: 0, 3: 1}
    # as many ranks as clients, not one more
    check_world_size(4, 4, server_hosts=True)
    with pytest.raises(HtflError, match="4 ranks give 4 client ranks but there are only 3 logical clients; "
                                        "start at most 3 ranks"):
        check_world_size(4, 3, server_hosts=True)
