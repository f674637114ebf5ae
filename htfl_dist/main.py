"""Entry point: ``python -m htfl_dist.main --config FILE [--out DIR] [--resume auto] [key=value ...]``.

The same program runs under torchrun, srun and mpirun, or alone (world size 1).
User mistakes end the job with one line and exit code 2; a full disk (or quota) with one line
naming the file and exit code 74; training that diverged for good, or a run in which no round
aggregated an upload, with one line and exit code 1;
any other failure prints the traceback of the failing rank, names the rank and its clients, and
brings every rank down (exit code 1). A run stopped by SIGTERM after every rank checkpointed exits
with 75 and leaves ``PREEMPTED`` in the run directory (torchrun reports any worker status as 1,
so batch scripts read the file). Rank 0 holds a lock on the run directory for the run's life,
so a second run on the same ``--out`` is refused at start-up. ``--check`` makes the start's checks
of the config and the run directory in this one process, writes nothing and exits (0, or 2 with
the one line): the launch scripts run it before they start any rank.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
import typing
from pathlib import Path

from htfl_dist.errors import (
    EXIT_DISK_FULL,
    EXIT_FAILURE,
    EXIT_USER_ERROR,
    ConfigError,
    DiskFullError,
    HtflError,
    clipped,
    disk_full_reason,
    is_disk_full,
)
from htfl_dist.runtime.liveness import report_once, tell_torchrun
from htfl_dist.runtime.run_directory import (
    PREEMPTED_MARKER,
    check_run_directory_free,
    out_directory,
    resume_source,
    take_run_directory,
)

__all__ = ["EXIT_DISK_FULL", "EXIT_FAILURE", "EXIT_PREEMPTED", "EXIT_USER_ERROR", "main", "parse_args", "run"]
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: checkpointed on SIGTERM, run again with --resume auto


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """One line in our format (exit 2), not argparse's usage block; ``--rounds 3`` is a config
        key written as an option: say how to write it."""
        match = re.search(r"unrecognized arguments: --([A-Za-z_][\w.]*)(?:=(\S+))?", message)
        if match:
            message += f"; config keys are key=value without dashes: write {match[1]}={match[2] or 'VALUE'}"
        raise ConfigError(f"{clipped(message)} (python -m htfl_dist.main --help lists the options)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _ArgumentParser(
        prog="python -m htfl_dist.main",
        description="Prototype-based heterogeneous federated learning, one SPMD program.",
    )
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--out", help="run directory (default: runs/<algorithm>-<config hash>)")
    parser.add_argument("--resume", default="never", metavar="auto|never|PATH",
                        help="auto: continue from the newest complete checkpoint in --out (or start fresh); "
                             "PATH: a run directory or one checkpoint directory to continue from")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE before the config is resolved, so that the algorithms, models, "
                             "datasets and generators it registers can be named (repeatable; see also the "
                             "config key plugins and the entry-point group htfl_dist.plugins)")
    parser.add_argument("--check", action="store_true",
                        help="resolve and check the config and the run directory as a start does, in this one "
                             "process, and exit (0: it would start; 2: the one line says why not), writing "
                             "nothing; the launch scripts run it before they start any rank")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --check: the ranks the launch will start (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. rounds=3 data.partition=pathological")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after options
    if args.world_size is not None and (not args.check or args.world_size < 1):
        raise ConfigError(f"--world-size {args.world_size}: " + ("at least 1" if args.check else
                          "only with --check (a launch's own world size comes from its launcher)"))
    return args


def check(args: argparse.Namespace) -> int:
    """``--check``: the config and the run directory as a start would find them, in one process
    and before any rank exists, so a launch script stops a mistake with our one line (exit 2)
    instead of that line followed by torchrun's ChildFailedError traceback and summary (exit 1),
    and nothing is written."""
    from htfl_dist.runtime.session import checked_config

    world_size = args.world_size or 1
    config = checked_config(args.config, args.overrides, args.imports, world_size)
    out = out_directory(args.out, config)
    check_run_directory_free(out, resume_source(args.resume, out))
    print(f"check: {config.algorithm}, {_count(config.num_clients, 'client')}, {_count(config.rounds, 'round')} "
          f"on {_count(world_size, 'rank')}; run directory {out}: ready to start", flush=True)
    return 0


def run(argv: list[str] | None = None) -> int:
    import torch

    from htfl_dist.runtime.bootstrap import (
        agree_to_start,
        detect_launch,
        make_deterministic,
        open_transport,
        pick_device,
    )
    from htfl_dist.runtime.session import checked_config

    args = parse_args(argv)
    if args.check:
        return check(args)
    launch = detect_launch()
    # every rank identically, before any communication (errors print once)
    config = checked_config(args.config, args.overrides, args.imports, launch.world_size)
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    make_deterministic()
    out = out_directory(args.out, config)
    resume_from = resume_source(args.resume, out)
    # the device and what train.cuda_graphs can do on it: refusals come before the run directory
    device = pick_device(config.runtime, launch)
    graphs = _training_note(config, device)
    refusal, lock = None, None
    if launch.rank == 0:
        try:
            lock = take_run_directory(out, resume_from)
        except HtflError as exc:
            refusal = exc
    try:
        transport = open_transport(config.runtime, launch, device)
        agree_to_start(transport, refusal)  # no rank goes on (or writes) unless rank 0 took the directory
        return _run_federation(config, launch, transport, device, out, resume_from, graphs)
    except HtflError:
        if lock is not None:
            lock.withdraw_record()
        raise
    finally:
        if lock is not None:
            lock.release()


def _training_note(config, device) -> str:
    """What the run line says of ``train.cuda_graphs`` and ``train.concurrent_clients`` (nothing at
    their defaults, off and 1)."""
    from htfl_dist.algorithms import get_algorithm
    from htfl_dist.runtime.startup import concurrent_clients, step_graphs

    entry = get_algorithm(config.algorithm)
    note = ""
    if config.train.cuda_graphs != "off":
        recorded, why_not = step_graphs(config, entry, device)
        note = ", local steps as CUDA graphs" if recorded else f", local steps eager: {why_not}"
    if config.train.concurrent_clients != 1:
        width, why_not = concurrent_clients(config, entry, device)
        note += {0: ", clients at once: as many as pays (measured)", 1: f", one client at a time: {why_not}"}.get(
            width, f", up to {width} clients at once")
    return note


def _run_federation(config, launch, transport, device, out: Path, resume_from: Path | None, graphs: str) -> int:
    from htfl_dist.metrics.writer import progress
    from htfl_dist.runtime.bootstrap import open_liveness, software_versions
    from htfl_dist.runtime.loop import RunContext, start

    liveness = open_liveness(config.runtime, transport)
    if launch.rank == 0:
        progress(f"htfl_dist: {config.algorithm}, {_count(config.num_clients, 'client')}, "
                 f"{_count(config.rounds, 'round')}; {_count(launch.world_size, 'rank')} via {launch.launcher} "
                 f"({transport.name}, {device}{graphs}); "
                 f"run directory {out}")
    context = RunContext(config, transport, device, out, resume_from,
                         extra_summary={"versions": software_versions(), "launcher": launch.launcher},
                         liveness=liveness)
    code = 0
    try:
        federation = start(context)
        summary = federation.run()
        federation.session.preemption.run_over = True
        if liveness is not None:
            liveness.finish()  # from here a rank may exit: its silence is no failure
        if federation.preempted_after is not None:
            _report_preemption(federation.preempted_after, out, launch.rank, transport)
            code = EXIT_PREEMPTED
        elif summary is not None:
            _report_finish(summary, out)
    except BaseException as exc:
        if transport.world_size > 1 and not isinstance(exc, KeyboardInterrupt):
            _fail(exc, context, launch.rank)  # does not return
        raise
    transport.close()
    return code


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _report_preemption(after_round: int, out: Path, rank: int, transport) -> None:
    """Rank 0 says where the checkpoint is and leaves the marker a batch script can test (the exit
    status does not survive torchrun); no rank leaves before it is written, so a launcher that ends
    the job when the first rank exits (srun --kill-on-bad-exit) cannot lose it."""
    if rank == 0:
        line = f"preempted: checkpoint after round {after_round} in {out}/checkpoints; continue with --resume auto"
        (out / PREEMPTED_MARKER).write_text(line + "\n")
        print(line, flush=True)
    transport.barrier()


def _report_finish(summary: dict, out: Path) -> None:
    """Rank 0, run complete: an earlier attempt's ``PREEMPTED`` marker no longer applies."""
    (out / PREEMPTED_MARKER).unlink(missing_ok=True)
    if summary["best_test_acc"] is None:
        print(f"done: no evaluated rounds to report; outputs in {out}", flush=True)
    else:
        print(f"done: best test_acc {summary['best_test_acc'] * 100:.2f}% at round {summary['best_round']}, "
              f"last {summary['last_test_acc'] * 100:.2f}%; outputs in {out}", flush=True)


def _fail(exc: BaseException, context, rank: int) -> None:
    """Say once for the whole job why it ends, then take this rank down. A user mistake is one
    line from the rank that found it. A collective that fails because a peer died or hung is
    named after that peer (the heartbeats tell which stopped), not after the socket error that
    every surviving rank sees; the ranks that fail only because the job is ending stay quiet."""
    transport, liveness = context.transport, context.liveness
    where = context.rank_description or f"rank {rank}"
    exc = _as_disk_full(exc) or exc
    if isinstance(exc, HtflError):
        line, code = f"htfl_dist: error on {where}: {one_line(exc)}", exc.exit_status
        if rank == 0 or not exc.said_by_rank0:
            report_once(line, liveness)
        else:
            code = _echo_status(exc)
    else:
        code = EXIT_FAILURE
        lost_peer = liveness is not None and liveness.report_lost_peers(where, type(exc).__name__)
        if not lost_peer and (liveness is None or liveness.claim_report()):
            traceback.print_exc()
            line = f"htfl_dist: {where} failed: {type(exc).__name__}: {exc}"
            print(line, file=sys.stderr, flush=True)
            tell_torchrun(line)
    sys.stdout.flush()
    transport.abort(code)
    os._exit(code)  # peers blocked in a collective are ended by the launcher (torchrun, srun, mpirun)


LINE_CHARS = 600
"""The longest error line: messages quote the user's values, and a pasted file or a runaway
shell expansion must not become a screenful (the start names the problem, the end the fix)."""


def one_line(error: BaseException) -> str:
    """``error``'s message as one bounded line."""
    text = str(error).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= LINE_CHARS else f"{text[:400]} ... {text[-(LINE_CHARS - 405):]}"


def _echo_status(error: HtflError) -> int:
    """The status of a rank that ends because rank 0 said why. torchrun lists every worker that
    exits non-zero in its summary, each with a "To enable traceback" pointer; there these ranks
    exit 0, so the summary names rank 0 and its line alone (the job's status is 1 either way).
    Under other launchers they share rank 0's status."""
    return 0 if "TORCHELASTIC_RUN_ID" in os.environ else error.exit_status


def _as_disk_full(exc: BaseException) -> DiskFullError | None:
    """An OSError for a full disk or quota raised outside our own writers (a partition cache, a
    TensorBoard file), as the same one line."""
    if isinstance(exc, DiskFullError) or not is_disk_full(exc):
        return None
    return DiskFullError(exc.filename or "a run output", None, disk_full_reason(exc))


def main(argv: list[str] | None = None) -> int:
    from htfl_dist.runtime import preemption, supervisor

    if supervisor.needs_supervisor(os.environ):  # under mpirun: this process names the rank if it is killed
        return supervisor.supervise([sys.executable, *sys.orig_argv[1:]])
    supervisor.become_supervised_worker()
    supervisor.follow_torchrun_agent()
    preemption.install()  # before torch starts threads: SIGTERM must reach the listener, not them
    from htfl_dist.runtime.bootstrap import launch_rank_hint

    try:
        return run(argv)
    except (HtflError, OSError) as exc:
        error = exc if isinstance(exc, HtflError) else _as_disk_full(exc)
        if error is None:
            raise
        line = f"htfl_dist: error: {one_line(error)}"
        rank = launch_rank_hint()
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
        if rank != 0 and error.said_by_rank0:
            return _echo_status(error)
        tell_torchrun(line)
        return error.exit_status
    except KeyboardInterrupt:
        print("htfl_dist: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
