"""Preemption and rank failure on real multi-process runs: nothing finished is lost, and the
job ends or recovers quickly with the same final metrics as an uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, REPO, SMOKE, _env, launch, read_metrics, run_program

ROUNDS = 4  # SIGTERM and kill -9 come at round 2: rounds 3 and 4 are left to resume


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("full")
    result = run_program(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                         f"rounds={ROUNDS}"])
    assert result.returncode == 0, result.stderr
    return [r["test_acc"] for r in read_metrics(out)]


def _start_torchrun(out, cache_dir, *extra, torchrun_args=()):
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=3", *torchrun_args,
               "-m", "htfl_dist.main", "--config", str(SMOKE), "--out", str(out),
               f"data.cache_dir={cache_dir}", f"rounds={ROUNDS}", *extra]
    return subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_line(process, needle, timeout=120):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"never saw {needle!r}: {''.join(seen)}")


def _worker_pids(agent_pid):
    out = subprocess.run(["pgrep", "-P", str(agent_pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


@pytest.mark.launch
def test_sigterm_checkpoints_at_the_round_boundary_then_resumes(uninterrupted, tmp_path, cache_dir):
    agent = _start_torchrun(tmp_path, cache_dir)
    _wait_for_line(agent, f"round 1/{ROUNDS}")  # the rest of the run is the slack for a loaded machine
    began = time.monotonic()
    agent.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank, as srun does
    stdout, stderr = agent.communicate(timeout=60)
    ended_s = time.monotonic() - began
    assert "preempted: checkpoint after round" in stdout, stdout + stderr
    print(f"SIGTERM -> all ranks checkpointed and exited in {ended_s:.1f} s")
    assert ended_s < 30
    stopped_at = len(read_metrics(tmp_path))
    assert 1 <= stopped_at < ROUNDS
    assert (tmp_path / "checkpoints" / f"round_{stopped_at:05d}" / "MANIFEST.json").is_file()
    assert not (tmp_path / "summary.json").exists()
    result = launch("torchrun", 3, ["--config", str(SMOKE), "--out", str(tmp_path), "--resume", "auto",
                                    f"data.cache_dir={cache_dir}", f"rounds={ROUNDS}"])
    assert result.returncode == 0, result.stderr
    assert [r["test_acc"] for r in read_metrics(tmp_path)] == uninterrupted


@pytest.mark.launch
def test_kill_9_of_torchrun_leaves_no_orphan_rank(tmp_path, cache_dir):
    """torchrun starts its ranks in sessions of their own, so a kill -9 of the agent alone reaches
    none of them: each rank asks for SIGTERM at the agent's death and checkpoints at the round
    boundary, as for a preemption, instead of running on with the device and the run directory."""
    agent = _start_torchrun(tmp_path, cache_dir, "rounds=50")
    _wait_for_line(agent, "round 1/50")
    workers = _worker_pids(agent.pid)
    assert len(workers) == 3
    began = time.monotonic()
    agent.kill()
    agent.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    print(f"kill -9 of torchrun -> every rank gone in {time.monotonic() - began:.1f} s")
    assert alive == [], f"ranks {alive} outlived their torchrun by 60 s"
    stopped_at = len(read_metrics(tmp_path))
    assert 1 <= stopped_at < 50
    assert (tmp_path / "checkpoints" / f"round_{stopped_at:05d}" / "MANIFEST.json").is_file()


@pytest.mark.launch
def test_elastic_restart_after_a_killed_rank(uninterrupted, tmp_path, cache_dir):
    """torchrun --max-restarts=1: kill -9 a client rank mid-run; the restart resumes from the
    last checkpoint and ends with the uninterrupted run's metrics."""
    agent = _start_torchrun(tmp_path, cache_dir, "--resume", "auto", "checkpoint_every=1",
                            torchrun_args=("--max-restarts=1",))
    _wait_for_line(agent, f"round 2/{ROUNDS}")
    workers = _worker_pids(agent.pid)
    assert len(workers) == 3
    killed_at = time.monotonic()
    os.kill(max(workers), signal.SIGKILL)  # the newest worker: a client rank
    stdout, stderr = agent.communicate(timeout=180)
    print(f"kill -9 -> restart, resume and finish in {time.monotonic() - killed_at:.1f} s")
    assert agent.returncode == 0, stdout + stderr
    assert [r["test_acc"] for r in read_metrics(tmp_path)] == uninterrupted
    assert (tmp_path / "summary.json").is_file()


def _rank_of(pid, variable=b"PMI_RANK"):
    with open(f"/proc/{pid}/environ", "rb") as handle:
        environ = handle.read().split(b"\0")
    for item in environ:
        if item.startswith(variable + b"="):
            return int(item.split(b"=")[1])
    return None


def _mpi_worker(marker: str, rank: int) -> int:
    """The process that is MPI rank ``rank`` of the job whose command line holds ``marker``: under
    mpirun each rank is a supervisor (the process mpirun started) and its worker, which has
    HTFL_DIST_MPI_SUPERVISOR in its environment."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()]
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            supervised = b"HTFL_DIST_MPI_SUPERVISOR=" in handle.read()
        if supervised and _rank_of(pid) == rank:
            return pid
    raise AssertionError(f"no worker of rank {rank} among {pids}")


@pytest.mark.launch
def test_hung_rank_ends_the_job_within_the_round_deadline(tmp_path, cache_dir):
    """Under MPI (no collective timeout) a frozen client rank is caught by the round deadline."""
    mpirun = str(BIN / "mpirun")
    command = [mpirun, "-n", "3", sys.executable, "-m", "htfl_dist.main", "--config", str(SMOKE),
               "--out", str(tmp_path), f"data.cache_dir={cache_dir}", "rounds=50", "runtime.round_deadline_s=6"]
    job = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_line(job, "round 1/50")
    marker = str(tmp_path)
    client = _mpi_worker(marker, 2)
    began = time.monotonic()
    os.kill(client, signal.SIGSTOP)  # a hung rank: alive, silent
    try:
        _, stderr = job.communicate(timeout=60)
    finally:
        os.kill(client, signal.SIGKILL) if os.path.exists(f"/proc/{client}") else None
    assert job.returncode != 0
    print(f"SIGSTOP (hung rank) -> job ended in {time.monotonic() - began:.1f} s")
    assert time.monotonic() - began < 30
    time.sleep(1)
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).stdout == b""  # no orphans
    assert "exceeded runtime.round_deadline_s=6; it was waiting for rank 2 (clients" in stderr, stderr
    assert "rank 0 (server)" in stderr


@pytest.mark.launch
@pytest.mark.parametrize(("signal_sent", "victim", "reporter"), [
    (signal.SIGKILL, 2, "rank 0 (server)"),  # a client rank dies
    (signal.SIGSTOP, 2, "rank 0 (server)"),  # a client rank hangs
    (signal.SIGSTOP, 0, "rank 1 (clients"),  # the server hangs
])
def test_a_lost_rank_is_named_once(tmp_path, cache_dir, signal_sent, victim, reporter):
    """A rank that dies or stops answering is named, with its clients, in exactly one line for
    the whole job, by the rank that watches it (rank 0 watches the client ranks, rank 1 the
    server), long before the collective timeout; no traceback of ours. torchrun's SIGKILL of a
    stopped process comes after its --shutdown_timeout."""
    agent = _start_torchrun(tmp_path, cache_dir, "rounds=50", "runtime.heartbeat_timeout_s=4",
                            torchrun_args=("--shutdown_timeout=2",))
    _wait_for_line(agent, "round 2/")
    workers = {_rank_of(pid, b"RANK"): pid for pid in _worker_pids(agent.pid)}
    began = time.monotonic()
    os.kill(workers[victim], signal_sent)
    try:
        _, stderr = agent.communicate(timeout=90)
    finally:
        os.kill(workers[victim], signal.SIGKILL) if os.path.exists(f"/proc/{workers[victim]}") else None
    ended_s = time.monotonic() - began
    ours = [line for line in stderr.splitlines() if line.startswith("htfl_dist:")]
    print(f"{signal.Signals(signal_sent).name} of rank {victim}: job ended in {ended_s:.1f} s; our lines: {ours}")
    assert agent.returncode != 0
    assert len(ours) == 1, stderr
    named = "rank 0 (server)" if victim == 0 else f"rank {victim} (clients ["
    assert ours[0].startswith(f"htfl_dist: {named}") and "stopped answering" in ours[0], ours
    assert f"seen by {reporter}" in ours[0]
    assert f"{REPO / 'htfl_dist'}/" not in stderr  # no traceback through our code from any rank
    assert ended_s < 30  # the collective timeout (runtime.timeout_s) is 600 s


@pytest.mark.launch
@pytest.mark.parametrize(("signal_sent", "victim", "named"), [
    pytest.param(signal.SIGKILL, 2, "rank 2 (clients [", id="kill-9-of-a-client-rank"),
    pytest.param(signal.SIGKILL, 0, "rank 0 (server)", id="kill-9-of-the-server"),
    pytest.param(signal.SIGSEGV, 1, "rank 1 (clients [", id="segfault-of-a-client-rank"),
])
def test_a_rank_killed_under_mpirun_is_named_once(tmp_path, cache_dir, signal_sent, victim, named):
    """Hydra SIGKILLs every other rank about 0.1 s after one dies, before any of their Python runs,
    so none of them can say who died: before, only mpirun's banner ended the job ('BAD TERMINATION
    ... EXIT CODE: 9'). The rank's supervisor, the process mpirun started, names it and its clients
    in one line, then the job ends; no process is left."""
    mpirun = str(BIN / "mpirun")
    command = [mpirun, "-n", "3", sys.executable, "-m", "htfl_dist.main", "--config", str(SMOKE),
               "--out", str(tmp_path), f"data.cache_dir={cache_dir}", "rounds=50"]
    job = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_line(job, "round 2/50")
    worker = _mpi_worker(str(tmp_path), victim)
    began = time.monotonic()
    os.kill(worker, signal_sent)
    _, stderr = job.communicate(timeout=60)
    ended_s = time.monotonic() - began
    ours = [line for line in stderr.splitlines() if line.startswith("htfl_dist:")]
    print(f"{signal.Signals(signal_sent).name} of MPI rank {victim}: job ended in {ended_s:.1f} s; our lines: {ours}")
    assert job.returncode != 0
    assert len(ours) == 1 and "Traceback" not in stderr, stderr
    line, name = ours[0], signal.Signals(signal_sent).name
    assert line.startswith(f"htfl_dist: {named}") and f"died: its process (pid {worker} on host " in line, line
    assert f"was killed by {name} (" in line and line.endswith("; ending the job"), line
    assert ended_s < 10
    time.sleep(1)
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).stdout == b""  # no orphans


@pytest.mark.launch
def test_a_rank_that_raises_ends_every_rank(tmp_path, cache_dir):
    """A client rank fails (its client's checkpoint is corrupt): it is named, all ranks end."""
    first = run_program(["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                        "rounds=1", "checkpoint_every=1"])
    assert first.returncode == 0, first.stderr
    victim = tmp_path / "checkpoints" / "round_00001" / "client_4.pt"
    victim.write_bytes(victim.read_bytes()[:64])
    began = time.monotonic()
    result = launch("torchrun", 3, ["--config", str(SMOKE), "--out", str(tmp_path), f"data.cache_dir={cache_dir}",
                                    "--resume", "auto", "rounds=2", "runtime.placement=round_robin"], timeout=120)
    print(f"exception on rank 1 -> job ended in {time.monotonic() - began:.1f} s")
    assert result.returncode != 0
    assert "error on rank 1 (clients [0, 2, 4]): checkpoint file" in result.stderr
    assert "client_4.pt cannot be read" in result.stderr


@pytest.mark.launch
def test_start_up_is_inside_the_deadline(tmp_path):
    """Data preparation, model building and the handshake are watched too: under MPI a rank stuck
    there would otherwise hang the job. An empty partition cache makes rank 0 read and split the
    dataset while the others wait at the barrier, which takes far longer than the 0.2 s deadline."""
    result = launch("mpirun", 3, ["--config", str(SMOKE), "--out", str(tmp_path / "run"),
                                  f"data.cache_dir={tmp_path / 'cold-cache'}", "runtime.round_deadline_s=0.2"],
                    timeout=120)
    assert result.returncode != 0
    assert "start-up exceeded runtime.round_deadline_s=0.2" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


FAILED_IN_PROCESS = """
import sys, time
from htfl_dist.runtime import local_training, session
from htfl_dist.runtime.simulate import simulate

def planted(*args, **kwargs):
    raise RuntimeError("planted failure")

smoke, cache, out = sys.argv[1:4]
settings = ["data.cache_dir=" + cache, "rounds=1", "num_clients=4"]
simulate(smoke, settings, out=out + "/warm")  # the partition cache: start-up well inside the deadline below
for name, owner, method in (("start-up", session.Session, "_place"),
                            ("round", local_training.LocalTraining, "train")):
    original = getattr(owner, method)
    setattr(owner, method, planted)
    try:
        simulate(smoke, [*settings, "runtime.round_deadline_s=4"], out=out + "/" + name)
    except RuntimeError as error:
        assert "planted" in str(error), error
    else:
        sys.exit("the planted failure did not fail the " + name)
    setattr(owner, method, original)
time.sleep(8.0)  # two deadlines: an armed watchdog would have ended this process with status 1
print("alive")
"""


@pytest.mark.launch
def test_a_run_that_fails_in_process_leaves_no_armed_deadline_behind(tmp_path, cache_dir):
    """A run that raises in start-up or in a round, inside a process that lives on (a notebook,
    a test worker), must not leave its round watchdog armed: round_deadline_s later it would end
    that process with exit status 1 (what crashed a pytest worker an hour into the suite)."""
    result = subprocess.run([sys.executable, "-c", FAILED_IN_PROCESS, str(SMOKE), str(cache_dir), str(tmp_path)],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("alive"), result.stdout + result.stderr


BLOCKED_IN_GLOO = """
import datetime, sys, time
from htfl_dist.runtime import preemption
preemption.install().grace_s = 2.0
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
if rank == 0:
    time.sleep(60)  # never sends
print("blocked", flush=True)
dist.recv(torch.zeros(1), src=0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.launch
def test_sigterm_grace_holds_for_a_rank_blocked_in_a_collective(tmp_path):
    """A rank blocked in a Gloo recv never runs Python signal handlers (Gloo retries after EINTR),
    so a handler-started grace timer would never start. The SIGTERM listener thread sees the
    signal at once: the rank announces it and exits when the grace period ends."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_IN_GLOO)
    port = str(_free_port())
    server = subprocess.Popen([sys.executable, str(script), "0", port], cwd=REPO, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    blocked = subprocess.Popen([sys.executable, str(script), "1", port], cwd=REPO, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert blocked.stdout.readline().strip() == "blocked"
        time.sleep(0.5)  # inside dist.recv
        began = time.monotonic()
        blocked.send_signal(signal.SIGTERM)
        _, stderr = blocked.communicate(timeout=30)
        ended_s = time.monotonic() - began
    finally:
        server.kill()
        blocked.kill()
    print(f"SIGTERM to a rank blocked in Gloo: exited {ended_s:.1f} s later (grace 2 s)")
    assert "SIGTERM received" in stderr
    assert "no round boundary within runtime.preempt_grace_s=2" in stderr
    assert blocked.returncode == 128 + signal.SIGTERM
    assert 1.5 < ended_s < 10


RANK_WITH_ANOTHER_SEED = """
import os, sys
from htfl_dist.main import main
sys.exit(main(sys.argv[1:] + (["seed=7"] if os.environ["RANK"] == "2" else [])))
"""


@pytest.mark.launch
def test_a_rank_with_another_config_is_named_before_anything_else_travels(tmp_path, cache_dir):
    """Rank 2 runs another seed (another experiment): rank 0's start-up handshake names it, before
    the placement's step times or any client is built, and nothing is written."""
    script = tmp_path / "another_seed.py"
    script.write_text(RANK_WITH_ANOTHER_SEED)
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=3", str(script), "--config", str(SMOKE),
               "--out", str(tmp_path / "run"), f"data.cache_dir={cache_dir}"]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "rank 2 disagrees with rank 0 on (config hash" in result.stderr, result.stderr[-3000:]
    assert "one training step takes" not in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
