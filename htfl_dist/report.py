"""Compare runs: ``python -m htfl_dist.report RUN_DIR [RUN_DIR ...] [--metric M] [--plot F.png] [--x KEY]
[--time-to ACC ...] [--csv F.csv] [--margins F.png] [--prototypes F.png] [--clients F.png] [--rounds R ...]``;
follow one as it goes: ``python -m htfl_dist.report --follow RUN_OR_STUDY``.

Prints a Markdown table (one row per run) on stdout, so it can be pasted or redirected into notes;
optionally writes learning curves and every run's rounds as CSV. Finished and running runs alike.
``--follow`` prints a run's rounds as they arrive (accuracy, seconds, ETA), or a study's cells with
their state whenever one changes, and ends when the run or the study ends.
User mistakes are one line on stderr and exit code 2, as for ``htfl_dist.main``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from htfl_dist.errors import EXIT_USER_ERROR, HtflError
from htfl_dist.metrics.figures import plot_class_margins, plot_client_spread, plot_prototype_projection
from htfl_dist.metrics.following import RunProgress, run_progress
from htfl_dist.metrics.report import (
    RUN_DIRECTORY,
    ReportError,
    markdown_table,
    plot_curves,
    read_run,
    report_table,
    withheld_runs,
    write_csv,
)
from htfl_dist.metrics.writer import _clock as clock
from htfl_dist.metrics.writer import format_progress
from htfl_dist.study.plan import STUDY_RECORD

DEFAULT_METRIC = "test_acc"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m htfl_dist.report",
                                     description="Table, learning curves and CSV of one or more run directories.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories (the --out of htfl_dist.main); with --follow one run or study directory")
    parser.add_argument("--follow", action="store_true",
                        help="follow one run (its rounds as they arrive) or study (its cells' state) until it ends")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="with --follow: seconds between looks at the files (default 2)")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help="numeric key of the metrics rows to plot (and, if not test_acc, to add to the table): "
                             "test_acc, test_acc_head, train_loss, margin, server_loss, proto_drift, ...")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="write the metric's learning curves here")
    parser.add_argument("--x", default="round", metavar="KEY",
                        help="the curves' x axis: round (default) or a numeric key of the rows, e.g. sim_clock_s "
                             "(accuracy against simulated time, participation.clock=true)")
    parser.add_argument("--time-to", type=float, nargs="+", default=[], metavar="ACC",
                        help="per accuracy ACC (test_acc, in percent), a column with the --x value (round, or "
                             "sim_clock_s) at which each run first reached it: time-to-accuracy, e.g. sync "
                             "against async rounds on one simulated clock")
    parser.add_argument("--csv", type=Path, metavar="FILE.csv", help="write every run's per-round rows here")
    parser.add_argument("--margins", type=Path, metavar="FILE.png",
                        help="FedTGP Fig. 1: per class, global prototype margin vs the best client's (fedtgp runs)")
    parser.add_argument("--prototypes", type=Path, metavar="FILE.png",
                        help="2-D PCA of the uploaded and global prototypes (runs with output.prototypes_every=N)")
    parser.add_argument("--clients", type=Path, metavar="FILE.png",
                        help="per run, a box of the clients' test accuracies per round (per_client.jsonl), "
                             "the unseen clients' beside them")
    parser.add_argument("--rounds", type=int, nargs="+", metavar="R",
                        help="rounds for --margins, --prototypes and --clients (default: up to 4, first to last)")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.follow:
        if len(args.runs) != 1:
            raise ReportError(f"--follow takes one run or study directory, got {len(args.runs)}")
        if not args.interval > 0:
            raise ReportError(f"--interval must be a number of seconds above 0, got {args.interval:g}")
        return follow(args.runs[0], args.interval)
    bad = [target for target in args.time_to if not 0 < target <= 100]
    if bad:
        raise ReportError(f"--time-to takes accuracies in percent, above 0 and at most 100; got {bad[0]:g}")
    runs = [read_run(path) for path in args.runs]
    table = report_table(runs, None if args.metric == DEFAULT_METRIC else args.metric, args.time_to, args.x)
    try:
        if args.plot:
            for labels in plot_curves(runs, args.metric, out=args.plot, x=args.x):
                print(f"identical {args.metric} curves, drawn as one line: {' = '.join(labels)}", file=sys.stderr)
            for label, reason in withheld_runs(runs, args.metric).items():
                print(f"no {args.metric} curve for {label}: {reason}", file=sys.stderr)
        if args.margins:
            plot_class_margins(runs, args.margins, args.rounds)
        if args.prototypes:
            plot_prototype_projection(runs, args.prototypes, args.rounds)
        if args.clients:
            plot_client_spread(runs, args.clients, args.rounds)
        if args.csv:
            write_csv(runs, args.csv)
    except OSError as exc:
        raise ReportError(f"cannot write {exc.filename or 'the output'} ({exc.strerror}); "
                          f"pass a path you can write to") from None
    print(table)
    for kind, path in (("plot", args.plot), ("csv", args.csv), ("margins", args.margins),
                       ("prototypes", args.prototypes), ("clients", args.clients)):
        if path:
            print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------- --follow

ENDED = ("finished", "stopped", "failed")


def follow(path: Path, interval: float, out: TextIO | None = None) -> int:
    """Follow a run directory or a study directory (one holding study.json) until it ends."""
    out = out or sys.stdout
    if (path / STUDY_RECORD).is_file():
        return _follow_study(path, interval, out)
    if not path.is_dir():
        raise ReportError(f"{path} is not a run directory: it {'is a file' if path.exists() else 'does not exist'}; "
                          f"{RUN_DIRECTORY} (or pass a study's --out)")
    return _follow_run(path, interval, out)


def _follow_run(path: Path, interval: float, out: TextIO) -> int:
    """The run's progress lines as its rows arrive, then how it ended."""
    shown, announced = 0, False
    while True:
        progress = run_progress(path)
        if progress.state != "waiting" and not announced:
            config = read_run(path).config
            print(f"following {path}: {config.get('algorithm')} on {(config.get('data') or {}).get('dataset')}, "
                  f"{progress.rounds} rounds (Ctrl-C stops following, not the run)", file=out, flush=True)
            announced = True
        for row in progress.rows:
            if row["round"] > shown:
                seconds = row.get("seconds") or 0.0
                so_far = dataclasses.replace(progress, rows=[r for r in progress.rows if r["round"] <= row["round"]])
                eta = so_far.eta_s
                print(format_progress(row["round"], progress.rounds, row, seconds, eta or 0.0), file=out, flush=True)
                shown = row["round"]
        if progress.state in ENDED:
            print(_ending(progress), file=out, flush=True)
            return 0
        time.sleep(interval)


def _ending(progress: RunProgress) -> str:
    if progress.state == "stopped":
        return f"stopped after round {progress.rounds_done} (checkpointed); continue it with --resume auto"
    summary = progress.summary or {}
    best, last = summary.get("best_test_acc"), summary.get("last_test_acc")
    if best is None or last is None:
        return "finished: no evaluated rounds"
    return f"finished: best acc {best * 100:.2f}% (round {summary.get('best_round')}), last {last * 100:.2f}%"


def _follow_study(path: Path, interval: float, out: TextIO) -> int:
    """The study's cells, one line each, printed again whenever one changes (the screen is
    redrawn on a terminal); ends when every cell has finished, failed or stopped."""
    from htfl_dist.study.schedule import CELL_LOG, failure_reason

    try:
        names = list(json.loads((path / STUDY_RECORD).read_text())["cells"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ReportError(f"{path / STUDY_RECORD} is damaged: not a study directory's record") from None
    last_view = ""
    while True:
        states = {}
        for name in names:
            cell_dir = path / "cells" / name
            progress = run_progress(cell_dir)
            if progress.state == "running" and failure_reason(cell_dir / CELL_LOG).startswith("htfl_dist: error"):
                progress = dataclasses.replace(progress, state="failed")
            states[name] = progress
        view = _study_view(path, states)
        if view != last_view:
            if out.isatty():
                print("\x1b[H\x1b[2J", end="", file=out)
            print(view, file=out, flush=True)
            last_view = view
        if all(progress.state in ENDED for progress in states.values()):
            return 0
        time.sleep(interval)


def _study_view(path: Path, states: dict[str, RunProgress]) -> str:
    counts = {state: sum(p.state == state for p in states.values())
              for state in ("finished", "running", "waiting", "stopped", "failed")}
    head = f"study {path}: " + ", ".join(f"{count} {state}" for state, count in counts.items() if count)
    rows = []
    for name, p in states.items():
        acc = p.rows[-1].get("test_acc") if p.rows else None
        rows.append([name, p.state, f"{p.rounds_done}/{p.rounds or '?'}", "" if acc is None else f"{acc * 100:.2f}",
                     "" if p.eta_s is None or p.state != "running" else clock(p.eta_s)])
    return head + "\n" + markdown_table(["cell", "state", "rounds", "last acc %", "ETA"], rows)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C ends the following, quietly
        return 130
    except HtflError as exc:
        print(f"htfl_dist: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
