"""The run directory a start takes (rank 0, before any rank talks): where it is, what a resume
continues from, and every refusal that keeps a run from writing over another: a path that cannot
become a directory, one a live run holds (its lock, ``bootstrap.lock_run_directory``), an entry of
the wrong kind, another run's outputs. ``--check`` makes the same refusals without writing."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from htfl_dist.errors import ConfigError, DiskFullError, HtflError, disk_full_reason, is_disk_full
from htfl_dist.metrics.following import PREEMPTED_MARKER


def resume_source(resume: str, out: Path) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return out
    source = Path(resume).resolve()
    if not source.is_dir():
        raise HtflError(f"--resume {resume}: no such directory; pass auto, never, a run directory "
                        f"or a checkpoints/round_NNNNN directory")
    from htfl_dist.runtime.checkpoint import find_checkpoint

    if find_checkpoint(source) is None:
        raise HtflError(f"--resume {resume}: no complete checkpoint (MANIFEST.json) there")
    return source


def out_directory(out: str | None, config) -> Path:
    if out is None:
        return (Path("runs") / f"{config.algorithm}-{config.config_hash()}").resolve()
    if not out.strip():  # --out "$RUN_DIR" with the variable unset
        raise ConfigError("--out is empty (an unset shell variable?); pass --out DIR, or leave --out out "
                          "for runs/<algorithm>-<config hash>")
    return Path(out).resolve()


def take_run_directory(out: Path, resume_from: Path | None):
    """Rank 0 takes the run directory: its lock first (one writer at a time), then refuse to write
    over another run: an existing run directory may only be continued from its own checkpoints
    (``--resume auto``, or a path inside it), and refuse a directory whose outputs could not be
    written (``check_run_directory``) before anything in it changes. Returns the held lock."""
    from htfl_dist.runtime.bootstrap import check_run_directory, lock_run_directory

    check_run_directory_free(out, resume_from)  # what can be refused before the lock file exists: none is left behind
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = lock_run_directory(out)
    except OSError as exc:
        raise _unwritable(out, exc) from None
    try:
        check_run_directory(out, {PREEMPTED_MARKER: "its preemption marker"})  # again, now that it is ours
        _refuse_another_run(out, resume_from)
        lock.record_holder()  # _check_out_dir's probe wrote a byte here a moment ago
    except OSError as exc:
        lock.release()
        raise _unwritable(out, exc) from None
    except HtflError:
        lock.release()
        raise
    return lock


def _unwritable(out: Path, exc: OSError) -> HtflError:
    """The line of an OS error taking the run directory: a full disk or quota has its own (exit
    status 74, as anywhere else in a run), anything else says the directory cannot be written."""
    if is_disk_full(exc):
        return DiskFullError(exc.filename or out, None, disk_full_reason(exc))
    return HtflError(f"cannot write the run directory {out} ({exc.strerror}); pass --out DIR you can write to")


def _refuse_another_run(out: Path, resume_from: Path | None) -> None:
    """An existing run directory may only be continued from its own checkpoints."""
    continuing_itself = resume_from is not None and (resume_from == out or out in resume_from.parents)
    if (out / "metrics.jsonl").exists() and not continuing_itself:
        how = "--resume auto" if resume_from is None else f"a new --out (resuming from {resume_from})"
        raise HtflError(f"run directory {out} already holds a run; pass {how}, or a new --out")


def check_run_directory_free(out: Path, resume_from: Path | None) -> None:
    """``--check``: each refusal of :func:`take_run_directory` that can be found without writing, in
    its words: a path that cannot become a directory, a directory in use by a live run, an entry
    of the wrong kind, another run's directory. Nothing is created or changed (where checkpoints/
    exists, ``check_run_directory`` creates and removes a probe file in it, as a start does)."""
    from htfl_dist.runtime.bootstrap import LOCK_FILE, check_run_directory, lock_run_directory

    existing = next(path for path in (out, *out.parents) if os.path.lexists(path))
    refusal = (errno.EEXIST if existing == out else errno.ENOTDIR) if not existing.is_dir() else \
        None if os.access(existing, os.W_OK | os.X_OK) else errno.EACCES
    if refusal is not None:
        raise _unwritable(out, OSError(refusal, os.strerror(refusal)))
    _probe(existing, out)
    if existing != out:
        return  # nothing there yet: the run makes it
    try:
        if (out / LOCK_FILE).exists():  # no lock file, no holder: it is made by the run that takes the directory
            lock_run_directory(out).release()
    except OSError as exc:
        raise _unwritable(out, exc) from None
    check_run_directory(out, {PREEMPTED_MARKER: "its preemption marker"})
    _refuse_another_run(out, resume_from)


def _probe(existing: Path, out: Path) -> None:
    """Write one byte where the run's first entry goes (a file in ``out``, or in a directory made
    in ``existing`` where ``out`` will be), then remove what was made: the mode bits pass a file
    system that refuses every write (proc, sysfs, a read-only mount, for root) and a full one
    (an empty file or directory still fits there), which the start met only when it wrote."""
    directory = existing if existing == out else None
    try:
        if directory is None:
            directory = Path(tempfile.mkdtemp(dir=existing, prefix=".htfl_dist-check."))
        fd, made = tempfile.mkstemp(dir=directory, prefix=".write-test.")
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(made)
    except OSError as exc:
        raise _unwritable(out, exc) from None
    finally:
        if directory is not None and directory != existing:
            os.rmdir(directory)
