"""Running a study's cells on this machine: N at once, each with its share of the cores, GPUs
packed k cells per device (or g devices per cell), multi-rank cells under torchrun.

Each cell is a child process in its own session, so a Ctrl-C at the terminal reaches only the
study, which then asks every running cell to checkpoint (SIGTERM, which the program turns into a
checkpoint at the round boundary and exit status 75). A study that dies without a word (SIGKILL,
a closed terminal) takes its cells along the same way: each cell's first process asks Linux for
SIGTERM when the study dies (``leader.py``). A rerun of the same command reads finished cells back
and continues the others from their checkpoints (``--resume auto``); a cell whose run directory a
live process still holds (one a killed study left checkpointing, or a run started by hand) is
waited for, then read back or resumed.

Each attempt of a cell writes its own ``output.log`` in the cell's directory; an earlier attempt's
is set aside first (``output.log.1``, ``.2``, ... oldest first), so a process of that attempt
still writing cannot mix its lines in, and a failed cell is named with its own last line.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from htfl_dist.metrics.writer import _clock as clock
from htfl_dist.metrics.writer import read_rows
from htfl_dist.study.plan import Cell, StudyError, finished

EXIT_PREEMPTED = 75  # the program's own status for "checkpointed on SIGTERM"
CELL_LOG = "output.log"
LEADER = Path(__file__).with_name("leader.py")
REASON_TAIL_BYTES = 64 * 1024


CUDA_CONTEXT_GIB = 0.5
"""What each process's CUDA context holds on its device outside PyTorch's allocator (a few
hundred MiB), counted per rank when cells are packed by memory."""


@dataclass(frozen=True)
class Slot:
    """Where one running cell goes: the CUDA devices it sees (empty: CPU), its torch threads per
    rank, and what each of its ranks' allocators may hold on the device (GiB; 0 = no cap)."""

    gpus: tuple[int, ...]
    threads: int
    memory_gib: float = 0.0


def assign_slots(jobs: int, cores: int, ranks_per_cell: int = 1, gpus: Sequence[int] = (),
                 gpus_per_cell: float = 1.0, memory_per_cell_gib: float | None = None,
                 device_gib: Mapping[int, float] | None = None) -> list[Slot]:
    """The slots of a study: at most ``jobs`` cells at once. On CPU each rank of a running cell
    gets an equal share of ``cores`` (at least one thread). With ``gpus``, either
    ``gpus_per_cell`` is a whole number g (a cell sees g devices of its own) or 1/k (k cells
    share a device, the count limit), or ``memory_per_cell_gib`` packs each device with as many
    one-device cells as its memory (``device_gib``) holds, and caps each rank's allocator at its
    share (the memory limit). Slots go round the devices, so fewer jobs than places still spread
    out."""
    if jobs < 1 or ranks_per_cell < 1 or cores < 1:
        raise StudyError(f"--jobs and --ranks must be >= 1 (got --jobs {jobs}, --ranks {ranks_per_cell})")
    if not gpus:
        if memory_per_cell_gib is not None:
            raise StudyError("--gpu-memory-per-cell packs cells onto GPUs, and no GPU is in use (--gpus)")
        threads = max(1, cores // (jobs * ranks_per_cell))
        return [Slot((), threads) for _ in range(jobs)]
    memory_gib = 0.0
    if memory_per_cell_gib is None:
        places = _gpu_places(list(gpus), gpus_per_cell)
    else:
        if gpus_per_cell != 1.0:
            raise StudyError("--gpus-per-cell and --gpu-memory-per-cell are two limits for one thing; give one")
        places = _memory_places(list(gpus), device_gib or {}, memory_per_cell_gib, ranks_per_cell)
        memory_gib = memory_per_cell_gib / ranks_per_cell
    chosen = places[:jobs]
    threads = max(1, cores // (len(chosen) * ranks_per_cell))
    return [Slot(place, threads, memory_gib) for place in chosen]


def _memory_places(gpus: list[int], device_gib: Mapping[int, float], per_cell_gib: float,
                   ranks_per_cell: int) -> list[tuple[int, ...]]:
    """floor(memory / (per cell + a CUDA context per rank)) places on each device, the devices
    taken in turn (every device's first place, then every device's second, ...)."""
    if per_cell_gib <= 0:
        raise StudyError(f"--gpu-memory-per-cell must be > 0 GiB, got {per_cell_gib:g}")
    need = per_cell_gib + CUDA_CONTEXT_GIB * ranks_per_cell
    counts = {}
    for gpu in gpus:
        counts[gpu] = int(device_gib[gpu] // need)
        if counts[gpu] == 0:
            raise StudyError(f"--gpu-memory-per-cell {per_cell_gib:g}: GPU {gpu} has {device_gib[gpu]:.1f} GiB, "
                             f"less than one cell needs ({need:g} GiB with {ranks_per_cell} CUDA context(s) of "
                             f"{CUDA_CONTEXT_GIB:g} GiB); leave it out with --gpus")
    return [(gpu,) for level in range(max(counts.values())) for gpu in gpus if counts[gpu] > level]


def _gpu_places(gpus: list[int], gpus_per_cell: float) -> list[tuple[int, ...]]:
    if gpus_per_cell >= 1:
        if not float(gpus_per_cell).is_integer():
            raise StudyError(f"--gpus-per-cell {gpus_per_cell}: a whole number of GPUs, or 1/k to share one")
        size = int(gpus_per_cell)
        if size > len(gpus):
            raise StudyError(f"--gpus-per-cell {size} needs {size} GPUs; {len(gpus)} visible")
        return [tuple(gpus[i:i + size]) for i in range(0, len(gpus) - size + 1, size)]
    if gpus_per_cell <= 0:
        raise StudyError(f"--gpus-per-cell must be > 0, got {gpus_per_cell}")
    per_gpu = round(1 / gpus_per_cell)
    if not math.isclose(per_gpu * gpus_per_cell, 1.0, rel_tol=1e-6):
        raise StudyError(f"--gpus-per-cell {gpus_per_cell}: use 1/k (0.5, 0.25, ...) so k cells share a GPU")
    return [(gpu,) for _ in range(per_gpu) for gpu in gpus]  # round the devices first


def cell_command(cell: Cell, out: Path, slot: Slot, ranks: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one cell in ``slot``. The slot's threads are passed as
    ``runtime.threads`` (plumbing: the config hash does not change) unless the study sets it."""
    args = cell.main_args(out)
    if "runtime.threads" not in cell.explicit_keys:
        args.append(f"runtime.threads={slot.threads}")
    if slot.memory_gib and "runtime.gpu_memory_gib" not in cell.explicit_keys:
        args.append(f"runtime.gpu_memory_gib={slot.memory_gib:.6g}")
    program = ["-m", "htfl_dist.main", *args]
    if ranks == 1:
        command = [sys.executable, *program]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", *program]
    env = dict(os.environ, OMP_NUM_THREADS=str(slot.threads))
    if slot.gpus:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices_for(slot.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return command, env


def visible_devices_for(gpus: tuple[int, ...], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a cell on the study's devices ``gpus`` (numbered as this
    process sees them, and checked against what it sees when ``--gpus`` is read). Under an
    inherited list (SLURM's allocation, say: ``2,3``) device 0 is its first entry, not physical
    GPU 0, which may belong to another job."""
    if inherited is None or not inherited.strip():
        return ",".join(map(str, gpus))
    entries = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    return ",".join(entries[gpu] for gpu in gpus)


@dataclass
class Running:
    cell: Cell
    slot: Slot
    process: subprocess.Popen
    log: TextIO


@dataclass
class Outcome:
    done: list[Cell] = field(default_factory=list)
    failed: list[Cell] = field(default_factory=list)
    interrupted: list[Cell] = field(default_factory=list)
    stopped: bool = False  # SIGTERM/SIGINT reached the study


class LocalRunner:
    """Launch the pending cells into free slots until all have ended or a signal stops the study."""

    def __init__(self, out: Path, slots: list[Slot], ranks: int, progress_every_s: float,
                 all_cells: list[Cell]) -> None:
        self.out, self.slots, self.ranks = out, slots, ranks
        self.progress_every_s = progress_every_s
        self.all_cells = all_cells
        self.outcome = Outcome()
        self.running: list[Running] = []
        self.held: dict[str, tuple[Cell, str]] = {}
        """Cells whose run directory another live process holds, by name: the cell and its holder."""
        self.signals = 0

    def run(self, pending: list[Cell], already_done: int) -> Outcome:
        pending = list(pending)
        self.already_done = already_done
        self.began = time.monotonic()
        self.rounds_at_start = self._rounds_done()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        last_line = time.monotonic()
        try:
            while self.running or ((pending or self.held) and not self.outcome.stopped):
                self._take_back_released(pending)
                free = [slot for slot in self.slots if all(r.slot is not slot for r in self.running)]
                while free and pending and not self.outcome.stopped:
                    cell = pending.pop(0)
                    if not self._held_elsewhere(cell):
                        self._start(cell, free.pop(0))
                time.sleep(0.3)
                self._reap()
                if self.progress_every_s and time.monotonic() - last_line >= self.progress_every_s:
                    last_line = time.monotonic()
                    print(self.progress_line(len(pending)), flush=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for entry in self.running:  # only when an exception ends the study early: the cells checkpoint
                if entry.process.poll() is None:
                    entry.process.send_signal(signal.SIGTERM)
        self.outcome.interrupted.extend(cell for cell, _ in self.held.values())  # stopped while waiting
        self.held.clear()
        return self.outcome

    def _on_signal(self, signum: int, frame) -> None:
        """First signal: every running cell checkpoints and exits; no new cell starts. A later one
        is passed on too (the program then ends at once)."""
        self.signals += 1
        self.outcome.stopped = True
        if self.signals == 1:
            print(f"study: {signal.Signals(signum).name}: the {len(self.running)} running cell(s) checkpoint "
                  f"and stop; run the same command again to continue", file=sys.stderr, flush=True)
        for entry in self.running:
            if entry.process.poll() is None:
                entry.process.send_signal(signal.SIGTERM)

    def _held_elsewhere(self, cell: Cell, holder: str | None = None) -> bool:
        """Whether a live process other than this study's holds the cell's run directory (its lock);
        if so the cell waits, named in one line, until that process ends."""
        holder = holder or run_directory_holder(cell.run_dir(self.out))
        if holder is None:
            return False
        self.held[cell.name] = (cell, holder)
        print(f"study: cell {cell.name}: its run directory is held by {holder}, a cell an earlier study left "
              f"checkpointing or a run started by hand; the cell goes on when that process ends (stop it to go on "
              f"sooner)", file=sys.stderr, flush=True)
        return True

    def _take_back_released(self, pending: list[Cell]) -> None:
        """Held cells whose holder has ended: read back when it finished them, else first in line."""
        for name, (cell, _) in list(self.held.items()):
            if run_directory_holder(cell.run_dir(self.out)) is not None:
                continue
            del self.held[name]
            if finished(cell, self.out):
                self.outcome.done.append(cell)
                print(f"study: cell {name} was finished by that process", flush=True)
            else:
                pending.insert(0, cell)

    def _start(self, cell: Cell, slot: Slot) -> None:
        run_dir = cell.run_dir(self.out)
        run_dir.mkdir(parents=True, exist_ok=True)
        command, env = cell_command(cell, self.out, slot, self.ranks)
        log = open_cell_log(run_dir)
        log.write(f"study: {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen([sys.executable, "-I", str(LEADER), str(os.getpid()), *command], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append(Running(cell, slot, process, log))

    def _reap(self) -> None:
        for entry in list(self.running):
            if not _has_exited(entry.process):
                continue
            _kill_group(entry.process.pid)  # what the cell's first process left behind goes with it
            code = entry.process.wait()
            entry.log.close()
            self.running.remove(entry)
            cell, run_dir = entry.cell, entry.cell.run_dir(self.out)
            log = run_dir / CELL_LOG
            if code == 0:
                self.outcome.done.append(cell)
            elif code == EXIT_PREEMPTED or (self.outcome.stopped and (run_dir / "PREEMPTED").exists()):
                self.outcome.interrupted.append(cell)
                if not self.outcome.stopped:  # a SIGTERM that reached the cell alone
                    print(f"study: cell {cell.name} stopped after a checkpoint (exit status {code}); the same "
                          f"command again continues it", file=sys.stderr, flush=True)
            elif not self.outcome.stopped and self._held_elsewhere(
                    cell, refused_by_holder(reason := failure_reason(log), run_dir)):
                pass  # another process took the directory between the look and the cell's start: wait for it
            else:
                self.outcome.failed.append(cell)
                print(f"study: cell {cell.name} failed ({exit_status_text(code)}): {reason}; log {log}",
                      file=sys.stderr, flush=True)

    def _rounds_done(self) -> int:
        total = 0
        for cell in self.all_cells:
            metrics = cell.run_dir(self.out) / "metrics.jsonl"
            if metrics.is_file():
                rows = read_rows(metrics)
                total += min(rows[-1]["round"], cell.rounds) if rows else 0
        return total

    def progress_line(self, waiting: int) -> str:
        """Cells done/running/failed/waiting and an ETA from the rounds finished since the start."""
        done = self.already_done + len(self.outcome.done)
        planned = sum(cell.rounds for cell in self.all_cells)
        rounds_now = self._rounds_done()
        rate = (rounds_now - self.rounds_at_start) / max(time.monotonic() - self.began, 1e-9)
        eta = f"ETA {clock((planned - rounds_now) / rate)}" if rate > 0 else "ETA unknown"
        held = f" ({len(self.held)} held by other processes)" if self.held else ""
        return (f"study: {done}/{len(self.all_cells)} cells done, {len(self.running)} running, "
                f"{len(self.outcome.failed)} failed, {waiting + len(self.held)} waiting{held}; "
                f"rounds {rounds_now}/{planned}; {eta}")


def run_directory_holder(run_dir: Path) -> str | None:
    """Who holds the run directory's lock ('pid P on host H (started T)'), or None when nobody
    does: no lock file, or one a dead process left (the kernel dropped its lock). The look takes
    the lock for a moment (bootstrap's own lock, the only way to ask it), so it is made only for
    a cell this study is not running."""
    from htfl_dist.runtime.bootstrap import LOCK_FILE, DirectoryInUse, lock_run_directory

    if not (run_dir / LOCK_FILE).is_file():
        return None
    try:
        lock = lock_run_directory(run_dir)
    except DirectoryInUse as exc:
        return exc.holder
    lock.release()
    return None


def refused_by_holder(reason: str, run_dir: Path) -> str | None:
    """The holder named by the program's refusal of a locked run directory, else None."""
    match = re.search(rf"run directory {re.escape(str(run_dir))} is in use by (.+?); wait for that run", reason)
    return match[1] if match else None


def open_cell_log(run_dir: Path) -> TextIO:
    """A new ``output.log`` for this attempt of the cell, the earlier attempt's set aside first
    (``output.log.N``, the next free N): a process of that attempt still writing (a rank left
    over by a killed study) writes on into the file set aside, never into this one."""
    log = run_dir / CELL_LOG
    if log.exists():
        number = 1
        while (run_dir / f"{CELL_LOG}.{number}").exists():
            number += 1
        log.rename(run_dir / f"{CELL_LOG}.{number}")
    return open(log, "x")  # closed when the cell ends


_PROGRAM_LINE = re.compile(r"htfl_dist(?:\.study)?: (?:error\b|\S.* failed: )")
_NOT_MEANINGFUL = re.compile(r"[\W_]*")  # blank, or a rule of '=' or '-' (torchrun's summary)


def failure_reason(log: Path) -> str:
    """Why a cell failed, from this attempt's own log: the program's last error line (torchrun
    repeats rank 0's after 'traceback :'), else the last line that says something (a traceback's
    exception line); never the study's own header line."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - REASON_TAIL_BYTES))
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines()]
    except OSError:
        return "no log"
    lines = [line for line in lines if not _NOT_MEANINGFUL.fullmatch(line) and not line.startswith("study: ")]
    for line in reversed(lines):
        match = _PROGRAM_LINE.search(line)
        if match:
            return line[match.start():]
    return lines[-1] if lines else "no output"


def exit_status_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _has_exited(process: subprocess.Popen) -> bool:
    """Whether the cell's first process has ended, left unreaped: until it is reaped its pid, and
    so its process group's id, cannot pass to another process."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
