"""Under mpirun, a supervisor per rank: the process mpirun started waits for a worker (the rank)
and, when the worker is killed (kill -9, the out-of-memory killer, a crash in native code), names
it with its clients in one line and exits, which makes mpirun end the job. Needed because
MPICH's Hydra SIGKILLs every other rank within about 0.1 s of one dying, before any of their
Python code runs, so the survivors cannot name it (``runtime.liveness`` has the rest)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping

from htfl_dist.parent_death import ask_for_parent_death_signal
from htfl_dist.runtime.liveness import describe_plain

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
