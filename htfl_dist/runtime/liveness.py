"""Liveness: which rank stopped answering, said once for the whole job.

A rank that dies (kill -9, OOM killer, a lost node) or hangs (SIGSTOP, a deadlock, a stalled
file system) shows up on the others only as a collective that fails or never returns, and the
error names a socket, not a rank. So every rank beats: a thread increments a counter of its own
in the job's rendezvous store (the TCP store torchrun's agent, srun's rank 0 or mpirun's rank 0
hosts for Gloo/NCCL) every ``interval_s``. The counters live outside the collectives: a rank
blocked in a Gloo call keeps beating, a stopped or dead one does not.

* Rank 0 watches every client rank, rank 1 watches rank 0: a counter that has not moved for
  ``runtime.heartbeat_timeout_s`` ends the job at once, with one line naming the rank and its
  clients, instead of waiting for the collective timeout.
* A rank whose collective fails (a peer's socket closed) asks the store which counters stopped
  before it prints anything, so it can name the dead peer instead of its own socket error.
* The first rank to report claims the job's one report (an atomic counter in the store); the
  ranks that fail after it, because the job is ending, stay quiet.

Under the MPI backend there is no store: the round deadline names the rank that rank 0 was
waiting for (see ``watchdog.py``). A rank that dies under mpirun cannot be named by the others:
MPICH's Hydra SIGKILLs every other rank within about 0.1 s, before any of their Python code runs
(measured: no signal handler of theirs ever runs). So under mpirun each rank is two processes
(:func:`supervise`): the one mpirun started waits for a worker, which is the rank; when the worker
is killed (kill -9, the out-of-memory killer, a crash in native code), the waiting process names
it with its clients in one line, and then exits, which makes mpirun end the job.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from htfl_dist.parent_death import ask_for_parent_death_signal

T = TypeVar("T")

STORE_OP_TIMEOUT_S = 10.0
"""How long one store operation of the liveness channel may take before the store counts as lost."""


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's rendezvous store listens, and the key prefix of this launch attempt."""

    host: str
    port: int
    hosted_by_rank0: bool
    """True when rank 0's process serves the store (srun, mpirun): if rank 0 dies, so does the
    store. Under torchrun the agent serves it and outlives its workers."""
    prefix: str


def open_store(address: StoreAddress, rank: int, world_size: int, timeout_s: float, serve: bool):
    """A client (or, with ``serve``, the server) of the job's TCP store, namespaced by attempt."""
    import torch.distributed as dist

    store = dist.TCPStore(address.host, address.port, world_size, is_master=serve,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(address.prefix, store)


def tell_torchrun(line: str) -> None:
    """Put our one line into torchrun's per-rank error file, so the failure summary torchrun
    prints after it shows the reason instead of "To enable traceback see: ...". Best effort:
    outside torchrun the variable is unset, and an unwritable file must not mask the error."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as file:
            # torchrun's own record format: its summary shows py_callstack as the traceback
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, file)
    except OSError:
        pass


def machine_identity() -> str:
    """This machine, told apart from others that share a host name (containers): host + boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def describe_plain(rank: int) -> str:
    return "rank 0 (server)" if rank == 0 else f"rank {rank}"


class Liveness:
    """This rank's heartbeat, its watch over the peers it is responsible for, and the job's one
    failure report. Never raises: a lost store only means less precise failure lines."""

    def __init__(self, address: StoreAddress, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = min(1.0, timeout_s / 5)
        self.hosted_by_rank0 = address.hosted_by_rank0
        self.describe: Callable[[int], str] = describe_plain
        self._store = open_store(address, rank, world_size, STORE_OP_TIMEOUT_S, serve=False)
        self._store_lost = False
        self._finished = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat(self._store)  # exists before any peer can look for it
        self._store.set(f"liveness/process/{rank}", f"{machine_identity()} {os.getpid()}")
        threading.Thread(target=self._beat_forever, name="htfl-heartbeat", daemon=True).start()

    def _op(self, operation: Callable[[Any], T], lost: T) -> T:
        """One store operation, or ``lost`` once this rank finished or the store is unreachable.
        Under a lock that :meth:`finish` takes too, so no thread is inside the store's C++
        client when the process exits (the interpreter would abort: SIGABRT, exit -6)."""
        with self._lock:
            if self._finished:
                return lost
            try:
                return operation(self._store)
            except Exception:
                self._store_lost = True
                return lost

    # ------------------------------------------------------------------ heartbeat

    def _key(self, rank: int) -> str:
        return f"liveness/beat/{rank}"

    def _beat(self, store: Any) -> None:
        store.add(self._key(self.rank), 1)

    def _beat_forever(self) -> None:
        while not (self._store_lost or self._stop.wait(self.interval_s)):
            self._op(self._beat, None)

    def finish(self) -> None:
        """This rank is done (finished, or checkpointed on SIGTERM) and may exit: its heartbeat
        stopping must not be taken for a failure, by the watchers or by a SIGTERM probe. From
        here no thread of this object touches the store."""
        self._op(lambda store: store.set(f"liveness/done/{self.rank}", "1"), None)
        with self._lock:
            self._finished = True
        self._stop.set()

    def _done(self, rank: int) -> bool:
        return self._op(lambda store: store.check([f"liveness/done/{rank}"]), False)

    def _counts(self, ranks: list[int]) -> dict[int, int] | None:
        """Every counter of ``ranks`` (add 0 reads without blocking on a missing key); None if
        the store cannot be reached."""
        return self._op(lambda store: {rank: int(store.add(self._key(rank), 0)) for rank in ranks}, None)

    # ------------------------------------------------------------------ watching

    def watched_ranks(self) -> list[int]:
        """Rank 0 watches every client rank; rank 1 watches rank 0 (someone must say when the
        server stops); the others watch nobody (rank 0 speaks for them)."""
        if self.rank == 0:
            return list(range(1, self.world_size))
        return [0] if self.rank == 1 else []

    def watch(self, describe: Callable[[int], str], on_silent: Callable[[str], None]) -> None:
        """Start watching; ``on_silent(line)`` is called once with the line that names a rank
        whose counter has not moved for ``timeout_s`` (or rank 0, when the store it served is
        gone); it is expected to end the process."""
        self.describe = describe
        watched = self.watched_ranks()
        if watched:
            threading.Thread(target=self._watch, args=(watched, on_silent), name="htfl-liveness",
                             daemon=True).start()

    def _watch(self, watched: list[int], on_silent: Callable[[str], None]) -> None:
        last = self._counts(watched) or {}
        moved_at = dict.fromkeys(watched, time.monotonic())
        while not self._stop.wait(self.interval_s):
            counts = self._counts(watched)
            if self._finished:
                return
            now = time.monotonic()
            if counts is None:
                if self.rank == 1 and self.hosted_by_rank0:
                    on_silent(self._lost_line(0, "the rendezvous store it serves stopped answering"))
                return  # the store's host is gone: the collectives fail on their own
            for rank, count in counts.items():
                if count != last.get(rank):
                    last[rank], moved_at[rank] = count, now
                elif now - moved_at[rank] > self.timeout_s and not self._done(rank):
                    line = self._lost_line(rank, f"no heartbeat for {now - moved_at[rank]:.0f} s")
                    self.kill_if_local(rank)
                    on_silent(line)
                    return

    def kill_if_local(self, rank: int) -> None:
        """SIGKILL a silent rank's process when it runs on this machine. A stopped (SIGSTOP) or
        wedged process ignores the launcher's SIGTERM, and torchrun waits 30 s before its SIGKILL
        when a worker fails, so the job would linger; the job is ending anyway. Best effort."""
        key = f"liveness/process/{rank}"
        # check first: get() would wait for a key that was never written
        found = self._op(lambda store: store.get(key).decode() if store.check([key]) else "", "")
        machine, _, pid = found.rpartition(" ")
        if machine == machine_identity():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def _lost_line(self, rank: int, evidence: str) -> str:
        return (f"htfl_dist: {self.describe(rank)} stopped answering ({evidence}: its process died, "
                f"hung or lost the network); ending the job (seen by {self.describe(self.rank)})")

    # ------------------------------------------------------------------ after a failure

    def silent_peers(self, observe_s: float | None = None) -> list[int]:
        """Peers whose counter does not move over ``observe_s`` (default: three beats), asked by
        a rank whose collective just failed. A dead peer's socket closes at once; its counter is
        the proof of who it was."""
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        before = self._counts(peers)
        time.sleep(observe_s if observe_s is not None else 3 * self.interval_s)
        after = self._counts(peers)
        if before is None or after is None:
            return [0] if self.hosted_by_rank0 and self.rank != 0 and not self._finished else []
        return [rank for rank in peers if after[rank] == before[rank] and not self._done(rank)]

    def claim_report(self) -> bool:
        """True for the first rank of the job to report a failure (it prints the one line); the
        store being gone counts as a claim, so a line is never lost."""
        return self._op(lambda store: int(store.add("liveness/reports", 1)) == 1, True)

    def someone_reported(self, wait_s: float = 0.0) -> bool:
        """Whether another rank already reported (waiting up to ``wait_s`` for it)."""
        deadline = time.monotonic() + wait_s
        while True:
            reports = self._op(lambda store: int(store.add("liveness/reports", 0)), None)
            if reports is None:
                return False
            if reports > 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def lost_peers_line(self, seen_by: str, cause: str) -> str | None:
        """After a failed collective or a launcher's SIGTERM: who stopped answering. Returns the
        line naming the peers whose heartbeats stopped, for this rank to print; "" when another
        rank reports (or already did): stay quiet; None when every peer is alive (the failure
        is this rank's own)."""
        # rank 0 speaks for the job; a client rank gives it a moment first
        wait_s = 0.0 if self.rank == 0 else 4 * self.interval_s + 1.0
        if self._finished:
            return None  # done: the peers that leave now leave because they are done too
        if self.someone_reported(wait_s):
            return ""
        silent = self.silent_peers()
        if self._finished:
            return None  # the run ended meanwhile: the peers left because they were done
        if not silent:
            return None
        if self.rank != 0 and not (self.rank == 1 and 0 in silent):
            return ""  # rank 0 names a lost client rank; rank 1 names a lost rank 0
        for peer in silent:
            self.kill_if_local(peer)
        names = ", ".join(self.describe(peer) for peer in silent)
        return (f"htfl_dist: {names} stopped answering (no heartbeat: died, hung or lost the network); "
                f"ending the job (seen by {seen_by}: {cause})")


    def report_lost_peers(self, seen_by: str, cause: str) -> bool:
        """:meth:`lost_peers_line`, said: True when the job failed because a peer was lost
        (the line printed here, or by another rank), False when every peer is alive."""
        line = self.lost_peers_line(seen_by, cause)
        if line:
            report_once(line, self)
        return line is not None

    def end_job(self, line: str) -> None:
        """What a watcher does with a silent peer: the job's one line, then exit 1 (the launcher
        ends the ranks still blocked on the lost one)."""
        report_once(line, self)
        sys.stdout.flush()
        os._exit(1)


# ------------------------------------------------------------------ under mpirun: a supervisor per rank

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
"""What mpirun/mpiexec put in each rank's environment (MPICH's Hydra, Open MPI, PMIx): the list
``bootstrap.detect_launch`` reads too."""
SUPERVISOR_ENV = "HTFL_DIST_MPI_SUPERVISOR"
"""In a supervised worker's environment: '<supervisor pid>:<descriptor of the pipe to it>'."""
SUPERVISOR_DRAIN_S = 1.0
"""How long the supervisor waits after its line before it exits: mpirun forwards a rank's stderr
asynchronously and tears the job down as soon as it sees the exit, so without the pause the line
that names the dead rank can come after mpirun's banner, or not at all."""
_SIGNAL_HINTS: dict[int, str] = {
    signal.SIGKILL: "kill -9, or the kernel's out-of-memory killer: see dmesg",
    signal.SIGSEGV: "a crash in native code", signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "an abort in native code"}


def needs_supervisor(env: Mapping[str, str]) -> bool:
    """A process mpirun started (an MPI rank) that is not yet a supervised worker."""
    return SUPERVISOR_ENV not in env and any(name in env for name in MPI_RANK_VARS)


def supervise(command: list[str]) -> int:
    """Be this MPI rank's supervisor: run ``command`` (this very program again) as the rank's
    worker, in this process group, with mpirun's environment and descriptors (its PMI channel
    among them), and return the worker's exit status. A worker killed by a signal this process
    did not pass on is named in one line (the description it sent through :func:`tell_supervisor`,
    else its rank), and the status is 128 + the signal. SIGINT and SIGTERM reach the worker from
    the launcher (Hydra signals each rank's process group); SIGTERM sent to this process alone is
    passed on too (a duplicate is one request to the worker's preemption listener)."""
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    os.set_blocking(read_end, False)
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _: received.append(signum))  # the worker gets its own
    env = {**os.environ, SUPERVISOR_ENV: f"{os.getpid()}:{write_end}"}
    worker = subprocess.Popen(command, env=env, close_fds=False)
    os.close(write_end)

    def pass_on(signum: int, _frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(OSError):
            worker.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    code = worker.wait()
    if code >= 0 or -code in received:
        return code if code >= 0 else 128 - code
    rank = next((os.environ[name] for name in MPI_RANK_VARS if name in os.environ), "?")
    name = _last_line(read_end) or (describe_plain(int(rank)) if rank.isdigit() else f"rank {rank}")
    print(_death_line(name, worker.pid, -code), file=sys.stderr, flush=True)
    time.sleep(SUPERVISOR_DRAIN_S)
    return 128 - code


def _death_line(name: str, pid: int, signum: int) -> str:
    try:
        how = signal.Signals(signum).name
    except ValueError:  # a real-time signal
        how = f"signal {signum}"
    hint = f" ({_SIGNAL_HINTS[signum]})" if signum in _SIGNAL_HINTS else ""
    return (f"htfl_dist: {name} died: its process (pid {pid} on host {socket.gethostname()}) was killed by "
            f"{how}{hint}; ending the job")


def _last_line(read_end: int) -> str:
    """The last line the worker sent (its rank and clients), bounded; '' if none."""
    data = b""
    with contextlib.suppress(OSError):  # BlockingIOError: nothing more now (a forked child may hold the pipe)
        while chunk := os.read(read_end, 65536):
            data = (data + chunk)[-4096:]
    lines = data.decode(errors="replace").splitlines()
    return lines[-1][:300] if lines else ""


def follow_torchrun_agent() -> None:
    """Under torchrun: get SIGTERM when the agent dies. torchrun starts each rank in a session of
    its own, so a kill -9 of the agent (an out-of-memory kill, a scheduler's hard stop, a harness
    that caps a run) reaches no rank, and the ranks would run on as orphans that hold the device
    and the run directory. SIGTERM, not SIGKILL: every rank of the node gets it at once, so they
    checkpoint together at the round boundary, as for a preemption. Elsewhere, nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()
    ask_for_parent_death_signal(signal.SIGTERM)
    if os.getppid() != agent:  # the agent died before the request was in place
        os._exit(1)


def become_supervised_worker() -> None:
    """In a supervised worker: die with the supervisor (``PR_SET_PDEATHSIG``: mpirun's teardown,
    or a kill -9 of it, must leave no orphan holding an MPI rank), and keep the pipe to it out of
    the processes this one starts. Without a supervisor, nothing."""
    supervisor = _supervisor()
    if supervisor is None:
        return
    pid, descriptor = supervisor
    ask_for_parent_death_signal(signal.SIGKILL)
    if os.getppid() != pid:  # the supervisor died before the request was in place
        os._exit(1)
    with contextlib.suppress(OSError):
        os.set_inheritable(descriptor, False)
        os.set_blocking(descriptor, False)  # a full pipe must never stall the rank


def tell_supervisor(description: str) -> None:
    """In a supervised worker: who this rank is ('rank 2 (clients [0, 4, 5])'), for the line its
    supervisor prints if this process is killed. Best effort; elsewhere, nothing."""
    supervisor = _supervisor()
    if supervisor is not None:
        with contextlib.suppress(OSError):
            os.write(supervisor[1], (description + "\n").encode())


def _supervisor() -> tuple[int, int] | None:
    pid, _, descriptor = os.environ.get(SUPERVISOR_ENV, "").partition(":")
    return (int(pid), int(descriptor)) if pid.isdigit() and descriptor.isdigit() else None


def report_once(line: str, liveness: Liveness | None) -> bool:
    """Print the job's failure line unless another rank already did; True if printed."""
    if liveness is not None and not liveness.claim_report():
        return False
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)
    return True
