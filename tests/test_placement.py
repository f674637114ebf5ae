"""Placement and participant sampling are pure functions of the config."""
import pytest

from htfl_dist.errors import HtflError
from htfl_dist.runtime.placement import check_world_size, clients_of_rank, hosting_rank, sample_participants


def test_every_client_hosted_exactly_once():
    for world in (1, 2, 3, 5):
        hosted = sorted(c for r in range(world) for c in clients_of_rank(r, world, 11))
        assert hosted == list(range(11))
        if world > 1:
            assert clients_of_rank(0, world, 11) == []  # rank 0 is the server only
    assert hosting_rank(4, 3) == 1 and hosting_rank(5, 3) == 2


def test_participants_seeded_and_independent_of_world():
    a = sample_participants(0, 3, 20, 0.5)
    assert a == sample_participants(0, 3, 20, 0.5)
    assert len(a) == 10 and a == sorted(set(a))
    assert a != sample_participants(0, 4, 20, 0.5)
    assert sample_participants(0, 0, 20, 1.0) == list(range(20))
    assert len(sample_participants(0, 0, 3, 0.1)) == 1


def test_too_many_ranks_is_a_user_error():
    check_world_size(5, 4)
    with pytest.raises(HtflError, match="at most 5 ranks"):
        check_world_size(6, 4)


# ---------------------------------------------------------------- launcher detection

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE")


def _launch_with(monkeypatch, **env):
    from htfl_dist.runtime import bootstrap

    for name in (*_LAUNCH_VARS, *bootstrap._MPI_RANK_VARS):
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
