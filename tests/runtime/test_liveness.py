"""The liveness channel against a real TCP store in this process: ranks are played by Liveness
objects (rank 0, the watcher) and by plain store counters that do or do not move."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, _env
from htfl_dist.runtime.liveness import Liveness as _Liveness
from htfl_dist.runtime.liveness import StoreAddress, open_store
from htfl_dist.runtime.supervisor import MPI_RANK_VARS, SUPERVISOR_DRAIN_S, SUPERVISOR_ENV, needs_supervisor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def address():
    address = StoreAddress("127.0.0.1", _free_port(), hosted_by_rank0=False, prefix="test")
    server = open_store(address, 0, 4, 10.0, serve=True)  # the agent's store
    yield address
    for member in MEMBERS:  # quiet their threads before the store goes
        member.finish()
    MEMBERS.clear()
    time.sleep(0.3)
    del server


MEMBERS: list = []


def Liveness(*args, **kwargs):
    member = _Liveness(*args, **kwargs)
    MEMBERS.append(member)
    return member


class Peer:
    """A rank that beats (or stops beating) through the store, like Liveness's thread does."""

    def __init__(self, address: StoreAddress, rank: int) -> None:
        self.store = open_store(address, rank, 4, 10.0, serve=False)
        self.rank, self.beating = rank, True
        threading.Thread(target=self._beat, daemon=True).start()
        MEMBERS.append(self)

    def finish(self) -> None:
        self.beating = False

    def _beat(self) -> None:
        while True:
            if self.beating:
                try:
                    self.store.add(f"liveness/beat/{self.rank}", 1)
                except Exception:
                    return
            time.sleep(0.1)


def describe(rank: int) -> str:
    return "rank 0 (server)" if rank == 0 else f"rank {rank} (clients [{rank}, {rank + 10}])"


def test_silent_peers_are_those_whose_counter_stands_still(address):
    watcher = Liveness(address, 0, 4, timeout_s=1.0)  # beats every 0.2 s
    alive, stopped, done = Peer(address, 1), Peer(address, 2), Peer(address, 3)
    stopped.beating = False
    done.beating = False
    done.store.set("liveness/done/3", "1")  # finished cleanly: its silence is no failure
    time.sleep(0.3)
    assert watcher.silent_peers(observe_s=0.6) == [2]
    del alive


def test_the_watcher_names_the_silent_rank_once_after_the_timeout(address):
    watcher = Liveness(address, 0, 3, timeout_s=1.0)
    Peer(address, 1)
    hung = Peer(address, 2)
    lines: list[str] = []
    began = time.monotonic()
    watcher.watch(describe, lines.append)
    time.sleep(0.5)
    assert lines == []  # everybody beats
    hung.beating = False
    stopped_at = time.monotonic()
    while not lines and time.monotonic() - began < 10:
        time.sleep(0.05)
    assert len(lines) == 1
    assert lines[0].startswith("htfl_dist: rank 2 (clients [2, 12]) stopped answering (no heartbeat for 1 s")
    assert lines[0].endswith("(seen by rank 0 (server))")
    assert 0.6 <= time.monotonic() - stopped_at < 2.5  # the timeout, give or take a poll and a beat
    time.sleep(0.5)
    assert len(lines) == 1  # said once


def test_rank_one_watches_the_server_and_the_others_watch_nobody(address):
    assert Liveness(address, 0, 4, 1.0).watched_ranks() == [1, 2, 3]
    assert Liveness(address, 1, 4, 1.0).watched_ranks() == [0]
    assert Liveness(address, 2, 4, 1.0).watched_ranks() == []


def test_one_report_per_job(address):
    first, second = Liveness(address, 0, 3, 1.0), Liveness(address, 1, 3, 1.0)
    assert not second.someone_reported()
    assert first.claim_report()
    assert second.someone_reported()
    assert not second.claim_report()


def test_after_a_failure_rank_zero_names_the_dead_peer_and_the_others_stay_quiet(address):
    server, client = Liveness(address, 0, 3, 0.5), Liveness(address, 1, 3, 0.5)
    dead = Peer(address, 2)
    time.sleep(0.3)
    dead.beating = False
    server.describe = client.describe = describe
    line = server.lost_peers_line("rank 0 (server)", "RuntimeError")
    assert line is not None and line.startswith("htfl_dist: rank 2 (clients [2, 12]) stopped answering")
    assert line.endswith("(seen by rank 0 (server): RuntimeError)")
    assert client.lost_peers_line("rank 1", "RuntimeError") == ""  # rank 0 names client ranks
    assert server.claim_report()
    assert client.lost_peers_line("rank 1", "RuntimeError") == ""  # reported already


def test_a_failure_with_every_peer_alive_is_this_ranks_own(address):
    server = Liveness(address, 0, 3, 0.5)
    Liveness(address, 1, 3, 0.5)
    Liveness(address, 2, 3, 0.5)
    assert server.lost_peers_line("rank 0 (server)", "ValueError") is None


def test_a_finished_rank_does_not_take_its_peers_exit_for_a_failure(address):
    """After the run ends (or checkpoints on SIGTERM) ranks exit one by one: a rank still in its
    SIGTERM probe must not name the peers that left before it."""
    client = Liveness(address, 1, 3, 0.5)
    Peer(address, 0).beating = False
    Peer(address, 2).beating = False
    client.describe = describe
    client.finish()
    assert client.lost_peers_line("rank 1", "SIGTERM from the launcher") is None


# ------------------------------------------------------------------ under mpirun: the supervisor names a killed rank

SUPERVISOR = "import sys; from htfl_dist.runtime.supervisor import supervise; sys.exit(supervise(sys.argv[1:]))"
WORKER = ("import os, signal, sys, time; from htfl_dist.runtime.supervisor import become_supervised_worker, "
          "tell_supervisor; become_supervised_worker(); {body}")


def _supervised(body: str, **popen) -> subprocess.Popen:
    """A supervisor as mpirun's rank 2 would start it, running a worker whose code is ``body``."""
    env = {**_env(), "PMI_RANK": "2"}
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR, sys.executable, "-c", WORKER.format(body=body)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.launch
@pytest.mark.parametrize("body,named", [
    ("tell_supervisor('rank 2 (clients [4, 5])'); os.kill(os.getpid(), signal.SIGKILL)", "rank 2 (clients [4, 5])"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "rank 2"),  # killed before the placement
])
def test_a_killed_worker_is_named_by_its_supervisor_in_one_line(body, named):
    began = time.monotonic()
    out, err = _supervised(body).communicate(timeout=30)
    assert err.startswith(f"htfl_dist: {named} died: its process (pid "), err
    assert err.endswith(" was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer: see dmesg); "
                        "ending the job\n"), err
    assert len(err.splitlines()) == 1 and out == ""
    assert time.monotonic() - began >= SUPERVISOR_DRAIN_S  # the line has time to reach mpirun before the exit


@pytest.mark.launch
def test_a_worker_that_exits_passes_its_status_through_quietly():
    supervisor = _supervised("print('hello', flush=True); sys.exit(75)")
    out, err = supervisor.communicate(timeout=30)
    assert (supervisor.returncode, out, err) == (75, "hello\n", "")


@pytest.mark.launch
def test_sigterm_to_the_supervisor_reaches_the_worker_and_is_no_death_to_report():
    """mpirun signals each rank's process group (both get it); sent to the supervisor alone it is
    passed on. A worker that dies of the signal its supervisor passed on is not reported."""
    handled = _supervised("signal.signal(signal.SIGTERM, lambda *_: sys.exit(75)); print('ready', flush=True); "
                          "time.sleep(30)")
    assert handled.stdout.readline() == "ready\n"
    handled.send_signal(signal.SIGTERM)
    assert handled.wait(timeout=30) == 75 and handled.stderr.read() == ""
    default = _supervised("print('ready', flush=True); time.sleep(30)")
    assert default.stdout.readline() == "ready\n"
    default.send_signal(signal.SIGTERM)
    assert default.wait(timeout=30) == 128 + signal.SIGTERM and default.stderr.read() == ""


@pytest.mark.launch
def test_a_worker_dies_with_its_supervisor():
    """mpirun's teardown (or a kill -9) of the supervisor leaves no worker holding an MPI rank."""
    supervisor = _supervised("print(os.getpid(), flush=True); time.sleep(60)")
    worker = int(supervisor.stdout.readline())
    supervisor.kill()
    supervisor.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie waits for init to reap it
    except FileNotFoundError:
        return False


def test_only_an_unsupervised_mpi_rank_needs_a_supervisor():
    from htfl_dist.runtime import bootstrap

    assert bootstrap.MPI_RANK_VARS is MPI_RANK_VARS  # one list of what mpirun sets
    assert needs_supervisor({"PMI_RANK": "0"}) and needs_supervisor({"OMPI_COMM_WORLD_RANK": "3"})
    assert not needs_supervisor({"PMI_RANK": "0", SUPERVISOR_ENV: "12:5"})
    assert not needs_supervisor({"RANK": "0", "WORLD_SIZE": "2"})  # torchrun: its agent names lost ranks


def test_torchruns_error_file_is_never_seen_empty_or_half_written(tmp_path, monkeypatch):
    """torchrun parses a failed rank's error file as soon as it sees the rank fail, and a rank
    can be ended (SIGTERM from the agent) between any two lines of Python: at every line of the
    write, the file is either the previous whole record or the new one, never empty (an empty
    file crashed the agent instead of restarting the job)."""
    import json

    from htfl_dist.runtime.liveness import tell_torchrun

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    tell_torchrun("first failure")
    seen: list[str] = []

    def at_every_line(frame, event, arg):
        seen.append(json.loads(error_file.read_text())["message"]["message"])
        return at_every_line

    sys.settrace(at_every_line)
    try:
        tell_torchrun("rank 2 stopped answering")
    finally:
        sys.settrace(None)
    assert set(seen) == {"first failure", "rank 2 stopped answering"}
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == "rank 2 stopped answering"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temp file left
