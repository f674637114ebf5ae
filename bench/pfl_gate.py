"""The side's end of bench/pfl_side_by_side.py's ``--lockstep`` gate: before each round a side
says it is ready and blocks until the driver lets it go; after the round it says it is done. The
driver lets one side run one round at a time, so rounds of different sides run seconds apart and
the VM's drifting speed hits them alike.

Active only when HTFL_PFL_BENCH_GATE is set, to ``ROUNDS,DIR``: the rounds the side plays and a
directory holding two named pipes (FIFOs) the driver made, ``DIR/go`` for its lines to the side
and ``DIR/say`` for the side's lines to the driver. Without it every function here returns at
once, so the sides run as they always did. Named pipes rather than inherited descriptors: a
side's processes are not all the driver's children (torchrun starts its workers with every
other descriptor closed), but they all see the variable and the paths.

One process of a side talks to the gate, its rank 0 (``RANK`` unset or "0"); the other ranks'
calls here return at once, and the side holds them by its own means (pfl's workers meet at a
barrier after rank 0's go, our ranks 1.. wait for rank 0's broadcast).

The driver holds both FIFOs open read-write from before the side starts (so no open here ever
blocks) to its end: when the driver dies or is done, ``go`` has no writer left and the side at
the gate reads end-of-file and fails; a side's death the driver sees by polling its process.
The lines, one each, in ASCII:

    side -> driver   ready R    (before round R; 0-based; blocks until go)
    driver -> side   go R
    side -> driver   done R     (after round R; a side's exit also ends its round)

``ready R`` for R at or past ROUNDS returns at once: a side whose gate sits at the start of a
round's work (ours: the download) need not know which call is the last.

Imported by the bare loop, pfl's runner and our plugin (bench/pfl_workload.py): stdlib only, as
the pfl venv has no htfl_dist."""
from __future__ import annotations

import os
from typing import IO

ENV = "HTFL_PFL_BENCH_GATE"
GO, SAY = "go", "say"
"""The FIFOs' names in the gate's directory."""
_pipes: dict[str, IO[str]] = {}


def active() -> bool:
    """Whether this process's side runs under a lockstep driver (on every rank of the side)."""
    return bool(os.environ.get(ENV))


def speaker() -> bool:
    """Whether this process talks to the gate: the side's rank 0 under a lockstep driver."""
    return active() and os.environ.get("RANK", "0") in ("", "0")


def rounds() -> int:
    """The rounds the side plays (the gate's ROUNDS)."""
    return int(os.environ[ENV].split(",", 1)[0])


def _open() -> tuple[IO[str], IO[str]]:
    if not _pipes:
        directory = os.environ[ENV].split(",", 1)[1]
        try:
            # non-blocking opens: with the driver gone (no FIFO, or no one at its end) they fail or
            # read end-of-file at once instead of waiting for a driver that never comes
            go_fd = os.open(os.path.join(directory, GO), os.O_RDONLY | os.O_NONBLOCK)
            say_fd = os.open(os.path.join(directory, SAY), os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise RuntimeError(f"{ENV}: cannot open the lockstep driver's gate ({exc}; the driver is gone)") from None
        for fd in (go_fd, say_fd):
            os.set_blocking(fd, True)  # os.open's descriptors are not inherited by programs the side runs
        _pipes["go"] = os.fdopen(go_fd, "r", encoding="ascii")
        _pipes["say"] = os.fdopen(say_fd, "w", encoding="ascii", buffering=1)  # line-buffered
    return _pipes["go"], _pipes["say"]


def ready(round_index: int) -> None:
    """Say round ``round_index`` may start and wait for the driver's go (nothing without the
    gate, on ranks other than 0, or past the last round)."""
    if not speaker() or round_index >= rounds():
        return
    go, say = _open()
    say.write(f"ready {round_index}\n")
    line = go.readline()
    if line.split() != ["go", str(round_index)]:
        raise RuntimeError(f"{ENV}: expected 'go {round_index}' from the lockstep driver, got {line.strip()!r}"
                           + (" (the driver is gone)" if not line else ""))


def done(round_index: int) -> None:
    """Say round ``round_index`` is finished (nothing without the gate or on ranks other than 0)."""
    if speaker():
        _open()[1].write(f"done {round_index}\n")
