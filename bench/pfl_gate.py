"""The side's end of bench/pfl_side_by_side.py's ``--lockstep`` gate: before each round a side
says it is ready and blocks until the driver lets it go; after the round it says it is done. The
driver lets one side run one round at a time, so rounds of different sides run seconds apart and
the VM's drifting speed hits them alike.

Active only when HTFL_PFL_BENCH_GATE is set, to ``R,W``: two file descriptors the driver passed
down (``subprocess.Popen(pass_fds=...)``), R for its lines to the side, W for the side's lines to
the driver. Without it every function here returns at once, so the sides run as they always did.
Pipes rather than files: when a side dies the driver reads end-of-file at once, and when the
driver dies the side does. The lines, one each, in ASCII:

    side -> driver   ready R    (before round R; 0-based; blocks until go)
    driver -> side   go R
    side -> driver   done R     (after round R; a side's exit also ends its round)

Imported by the bare loop, pfl's runner and our plugin (bench/pfl_workload.py): stdlib only, as
the pfl venv has no htfl_dist."""
from __future__ import annotations

import os
from typing import IO

ENV = "HTFL_PFL_BENCH_GATE"
_pipes: dict[str, IO[str]] = {}


def active() -> bool:
    """Whether this process runs under a lockstep driver."""
    return bool(os.environ.get(ENV))


def _open() -> tuple[IO[str], IO[str]]:
    if not _pipes:
        read_fd, write_fd = (int(fd) for fd in os.environ[ENV].split(","))
        for fd in (read_fd, write_fd):
            os.set_inheritable(fd, False)  # a child of the side must not keep the driver from seeing its exit
        _pipes["go"] = os.fdopen(read_fd, "r", encoding="ascii")
        _pipes["say"] = os.fdopen(write_fd, "w", encoding="ascii", buffering=1)  # line-buffered
    return _pipes["go"], _pipes["say"]


def ready(round_index: int) -> None:
    """Say round ``round_index`` may start and wait for the driver's go (nothing without the gate)."""
    if not active():
        return
    go, say = _open()
    say.write(f"ready {round_index}\n")
    line = go.readline()
    if line.split() != ["go", str(round_index)]:
        raise RuntimeError(f"{ENV}: expected 'go {round_index}' from the lockstep driver, got {line.strip()!r}"
                           + (" (the driver is gone)" if not line else ""))


def done(round_index: int) -> None:
    """Say round ``round_index`` is finished (nothing without the gate)."""
    if active():
        _open()[1].write(f"done {round_index}\n")


if active():
    _open()  # at import: the pipes are kept from any child the side starts from now on
