"""``python -m htfl_dist.study STUDY.yaml --out DIR [--set key=value ...] [--jobs N] [--ranks R]
[--gpus-per-cell G | --gpu-memory-per-cell GIB] [--slurm [--wait]] [--dry-run] [--table-only]``:
a paper's table in one command (docs/studies.md).

Exit status: 0 every cell finished; 2 a mistake in the study, a cell's config or DIR, or DIR in
use by another study (one line); 74 the disk or quota under DIR is full (one line);
75 stopped by SIGTERM/Ctrl-C after the running cells checkpointed (run the same command again);
100 + n when n cells failed or were stopped alone (at most 199); the others still ran.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import typing
from pathlib import Path

from htfl_dist.errors import DiskFullError, HtflError
from htfl_dist.study import plan, schedule, slurm, table

EXIT_USER_ERROR = 2
EXIT_FAILED_BASE = 100


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """One line in the study's format (exit 2), not argparse's usage block."""
        raise plan.StudyError(f"{message} (python -m htfl_dist.study --help lists the options)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _ArgumentParser(prog="python -m htfl_dist.study", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", help="study file (see studies/)")
    parser.add_argument("--out", required=True, help="study directory: DIR/cells/<key>-seed<s>/, DIR/table.md")
    parser.add_argument("--jobs", type=int, default=None,
                        help="cells at once (default: 1 on CPU, every GPU place with GPUs; with --slurm: "
                             "tasks at once, unlimited by default)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="key=value", dest="overrides",
                        help="overrides for every cell after the study's own (e.g. data.root=DIR rounds=50)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="these seeds instead of the study's")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="a plugin module every cell imports (repeatable), as python -m htfl_dist.main --import")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per cell (torchrun when > 1)")
    parser.add_argument("--gpus-per-cell", type=float, default=1.0,
                        help="GPUs a cell sees: a whole number, or 1/k for k cells per GPU (0.5, 0.25)")
    parser.add_argument("--gpu-memory-per-cell", type=float, default=None, metavar="GIB",
                        help="instead of --gpus-per-cell: pack each GPU with as many one-GPU cells as its memory "
                             "holds at GIB each (plus a CUDA context per rank), each rank's allocator capped at its "
                             "share (runtime.gpu_memory_gib)")
    parser.add_argument("--gpus", default=None,
                        help="CUDA device ids to use, comma-separated (default: every visible GPU; "
                             "'none': CPU only)")
    parser.add_argument("--cores", type=int, default=None, help="CPU cores to share (default: all usable)")
    parser.add_argument("--progress-every", type=float, default=30.0, metavar="S",
                        help="seconds between progress lines (0 = none)")
    parser.add_argument("--slurm", choices=("cpu", "gpu"), nargs="?", const="cpu", default=None,
                        help="submit one array job through slurm/cpu.sbatch (or gpu.sbatch) instead")
    parser.add_argument("--sbatch", default="", help="extra sbatch options for --slurm, one string")
    parser.add_argument("--wait", action="store_true", help="with --slurm: wait for the array, then write the table")
    parser.add_argument("--dry-run", action="store_true", help="validate every cell and print the commands")
    parser.add_argument("--table-only", action="store_true", help="write the table from DIR as it is")
    args = parser.parse_args(argv)
    for option, value in (("--jobs", args.jobs), ("--cores", args.cores), ("--ranks", args.ranks)):
        if value is not None and value < 1:  # 0 would silently mean the default; refused before anything is written
            raise plan.StudyError(f"{option} must be >= 1, got {value} (leave {option} out for the default)")
    return args


def visible_gpus(option: str | None) -> list[int]:
    """The devices the study may use, numbered as this process sees them (under an inherited
    ``CUDA_VISIBLE_DEVICES``, 0 is its first entry); ids it cannot see are refused here, before
    any cell starts."""
    if option is not None and option.strip().lower() == "none":
        return []  # without loading torch
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if option is None:
        return list(range(count))
    try:
        gpus = [int(item) for item in option.split(",") if item.strip()]
    except ValueError:
        raise plan.StudyError(f"--gpus {option!r}: comma-separated device ids, or none") from None
    for gpu in gpus:
        if not 0 <= gpu < count:
            inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise plan.StudyError(f"--gpus {option}: GPU {gpu} is not among the {count} this study sees"
                                  + (f" (CUDA_VISIBLE_DEVICES={inherited})" if inherited else ""))
    return gpus


def device_memory_gib(gpus: list[int]) -> dict[int, float]:
    """Each device's total memory in GiB, as PyTorch reports it."""
    from htfl_dist.runtime.bootstrap import gpu_memory_gib

    return {gpu: gpu_memory_gib(gpu) for gpu in gpus}


def default_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def study_directory(option: str) -> Path:
    """``--out`` as the directory the study keeps its cells in: a path that is, or lies under,
    something other than a directory is refused in one line before the study file is read
    (mkdir would say only 'File exists' or 'Not a directory', and --dry-run would print cell
    commands that cannot run there)."""
    try:
        out = Path(option).resolve()
    except (OSError, RuntimeError) as exc:  # a loop of symbolic links (RuntimeError before Python 3.13)
        raise plan.StudyError(f"--out {option}: {exc}; pass a new --out") from None
    existing = next(path for path in (out, *out.parents) if os.path.lexists(path))
    if not existing.is_dir():
        kind = "a regular file" if existing.is_file() else "not a directory"
        where = f"--out {out} is" if existing == out else f"--out {out} lies under {existing}, which is"
        raise plan.StudyError(f"{where} {kind}; the study keeps its cells in a directory there: pass a new --out")
    return out


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = study_directory(args.out)
    study = plan.validate(plan.expand(Path(args.study), args.overrides, args.seeds, tuple(args.imports)), args.ranks)
    if args.dry_run:
        return _dry_run(study, out, args.ranks)
    if args.table_only:  # no lock: a look at a study that may be running
        print(table.write_outputs(study, out), flush=True)
        return 0
    slots = None if args.slurm else _slots(args)  # a mistake in the devices or cores: before anything is written
    plan.check_directory(out, study)
    lock = plan.lock_directory(out)  # one study at a time in DIR: a second is refused here, in one line
    try:
        plan.claim_directory(out, study)
        lock.record_holder()
        pending = [cell for cell in study.cells if not plan.finished(cell, out)]
        print(f"study: {study.title}: {len(study.cells)} cells, {len(study.cells) - len(pending)} already finished; "
              f"directory {out}", flush=True)
        if slots is None:
            return _slurm(study, out, pending, args)
        return _run_here(study, out, pending, slots, args)
    finally:
        lock.release()


def _slots(args: argparse.Namespace) -> list[schedule.Slot]:
    gpus = visible_gpus(args.gpus)
    jobs = args.jobs or (sys.maxsize if gpus else 1)  # with GPUs, by default every place
    device_gib = device_memory_gib(gpus) if args.gpu_memory_per_cell is not None else None
    return schedule.assign_slots(jobs, args.cores or default_cores(), args.ranks, gpus, args.gpus_per_cell,
                                 args.gpu_memory_per_cell, device_gib)


def _run_here(study: plan.Study, out: Path, pending: list[plan.Cell], slots: list[schedule.Slot],
              args: argparse.Namespace) -> int:
    capped = f", {slots[0].memory_gib:.6g} GiB per rank" if slots[0].memory_gib else ""
    places = f", GPUs {' | '.join(','.join(map(str, s.gpus)) for s in slots)}" if slots[0].gpus else " on CPU"
    print(f"study: {len(slots)} at once, {args.ranks} rank(s) x {slots[0].threads} thread(s) per cell{capped}"
          f"{places}", flush=True)
    runner = schedule.LocalRunner(out, slots, args.ranks, args.progress_every, study.cells)
    outcome = runner.run(pending, len(study.cells) - len(pending))
    print(runner.progress_line(0), flush=True)
    print(table.write_outputs(study, out), flush=True)
    print(f"study: table in {out / 'table.md'}, {out / 'table.csv'}, {out / 'curves.png'}", flush=True)
    if outcome.stopped:
        print(f"study: stopped; {len(outcome.interrupted)} cell(s) checkpointed; run the same command again to "
              f"continue", file=sys.stderr, flush=True)
        return schedule.EXIT_PREEMPTED
    return _failed_status(len(outcome.failed) + len(outcome.interrupted))  # not finished either way


def _failed_status(failed: int) -> int:
    if failed:
        print(f"study: {failed} cell(s) did not finish", file=sys.stderr, flush=True)
        return EXIT_FAILED_BASE + min(failed, 99)
    return 0


def _dry_run(study: plan.Study, out: Path, ranks: int) -> int:
    for cell in study.cells:
        state = "finished" if plan.finished(cell, out) else "to run"
        launcher = "python" if ranks == 1 else f"torchrun --standalone --nproc_per_node={ranks}"
        print(f"{cell.name} [{cell.config_hash}, {cell.rounds} rounds, {state}]: {launcher} -m htfl_dist.main "
              f"{shlex.join(cell.main_args(out))}")
    print(f"study: {len(study.cells)} cells, {len(study.keys)} rows; all configs valid")
    return 0


def _slurm(study: plan.Study, out: Path, pending: list[plan.Cell], args: argparse.Namespace) -> int:
    if not pending:
        print(table.write_outputs(study, out), flush=True)
        return 0
    job, status = slurm.submit(pending, out, args.slurm, args.jobs, shlex.split(args.sbatch), args.wait)
    if not args.wait:
        print(f"study: the table once the array has run: python -m htfl_dist.study {shlex.quote(str(study.path))} "
              f"--out {shlex.quote(str(out))} --table-only", flush=True)
        return 0
    print(table.write_outputs(study, out), flush=True)
    unfinished = [cell for cell in study.cells if not plan.finished(cell, out)]
    for cell in unfinished:
        print(f"study: cell {cell.name} did not finish in array job {job} (sbatch status {status}); "
              f"see {out / 'slurm'}", file=sys.stderr, flush=True)
    return _failed_status(len(unfinished))


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except DiskFullError as exc:  # the study's own files; a cell's full disk fails that cell (exit 74 in its log)
        line = exc.advising("run the same command again: the study goes on where it stopped")
        print(f"htfl_dist.study: error: {line}", file=sys.stderr, flush=True)
        return exc.exit_status
    except HtflError as exc:
        print(f"htfl_dist.study: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
