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
(``runtime.supervisor``): the one mpirun started waits for a worker, which is the rank; when the worker
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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from htfl_dist.atomic import publish_bytes
from htfl_dist.errors import HtflError

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
    outside torchrun the variable is unset, and an unwritable file must not mask the error.
    Published whole (temp file, then rename): the agent parses this file as soon as it sees the
    rank fail, and a SIGTERM (the agent ending the other ranks) between truncating and writing
    left it empty, which torchrun cannot parse: it crashed instead of restarting the job."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torchrun's own record format: its summary shows py_callstack as the traceback
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                         "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(HtflError):
        publish_bytes(path, json.dumps(record).encode())


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


def report_once(line: str, liveness: Liveness | None) -> bool:
    """Print the job's failure line unless another rank already did; True if printed."""
    if liveness is not None and not liveness.claim_report():
        return False
    print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)
    return True
