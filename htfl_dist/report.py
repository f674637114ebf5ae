"""Compare runs: ``python -m htfl_dist.report RUN_DIR [RUN_DIR ...] [--metric M] [--plot F.png] [--csv F.csv]
[--margins F.png] [--prototypes F.png] [--clients F.png] [--rounds R ...]``.

Prints a Markdown table (one row per run) on stdout, so it can be pasted or redirected into notes;
optionally writes learning curves and every run's rounds as CSV. Finished and running runs alike.
User mistakes are one line on stderr and exit code 2, as for ``htfl_dist.main``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from htfl_dist.errors import EXIT_USER_ERROR, HtflError
from htfl_dist.metrics.figures import plot_class_margins, plot_client_spread, plot_prototype_projection
from htfl_dist.metrics.report import ReportError, plot_curves, read_run, report_table, withheld_runs, write_csv

DEFAULT_METRIC = "test_acc"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m htfl_dist.report",
                                     description="Table, learning curves and CSV of one or more run directories.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories (the --out of htfl_dist.main)")
    parser.add_argument("--metric", default=DEFAULT_METRIC,
                        help="numeric key of the metrics rows to plot (and, if not test_acc, to add to the table): "
                             "test_acc, test_acc_head, train_loss, margin, server_loss, proto_drift, ...")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="write the metric's learning curves here")
    parser.add_argument("--x", default="round", metavar="KEY",
                        help="the curves' x axis: round (default) or a numeric key of the rows, e.g. sim_clock_s "
                             "(accuracy against simulated time, participation.clock=true)")
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
    runs = [read_run(path) for path in args.runs]
    table = report_table(runs, None if args.metric == DEFAULT_METRIC else args.metric)
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


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except HtflError as exc:
        print(f"htfl_dist: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
