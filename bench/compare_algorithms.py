"""Benchmark: algorithms side by side on Fashion-MNIST, 20 HtCNN8 clients, over partitions and seeds.

Prints one row per run, then one row per (algorithm, partition) with the mean ± std over seeds of
the best and last accuracy, seconds per round, server seconds per round and bytes up vs theory.

    # the FedTGP issue's check: FedProto vs FedTGP, both partitions, 3 seeds, 50 rounds
    python bench/compare_algorithms.py --algorithms fedproto fedtgp \\
        --partitions dirichlet pathological --seeds 0 1 2 --rounds 50 --jobs 2
    # the foundation issue's check: FedProto vs Local, Dirichlet 0.1, one seed
    python bench/compare_algorithms.py
    # a variant is an algorithm name with overrides; extra overrides for every run go in --set
    python bench/compare_algorithms.py --algorithms fedproto+algo.client_reg=htfllib --set data.subsample=0.2

Every run writes its usual run directory under --out, named after (variant, partition, seed, rounds,
--set). A run whose directory already holds a finished summary is read back, not run again, so an
interrupted benchmark continues where it stopped.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from htfl_dist.main import resolved_config
from htfl_dist.metrics.report import markdown_table, read_run, read_summary, summarise

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    variant: str  # algorithm name, optionally "+key=value" overrides
    partition: str
    seed: int
    out: Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["fedproto", "local"],
                        help="algorithm names, each optionally with +key=value overrides")
    parser.add_argument("--partitions", nargs="+", default=["dirichlet"], choices=("dirichlet", "pathological"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (1 = single process)")
    parser.add_argument("--jobs", type=int, default=1, help="runs launched at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench"))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="extra config overrides")
    return parser.parse_args()


def plan(args: argparse.Namespace) -> list[Run]:
    """One run per (variant, partition, seed); the directory name pins everything that changes results."""
    extra = hashlib.sha1(" ".join(args.set).encode()).hexdigest()[:6] if args.set else "base"
    runs = []
    for seed in args.seeds:  # seed outermost: a cut-short benchmark still compares every variant
        for partition in args.partitions:
            for variant in args.algorithms:
                label = variant.replace("+", "_").replace("=", "-").replace("algo.", "")
                name = f"{label}-{partition}-s{seed}-r{args.rounds}-{extra}"
                runs.append(Run(variant, partition, seed, Path(args.out).resolve() / name))
    return runs


def config_and_overrides(run: Run, args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The config file and the key=value overrides a run is launched with."""
    algorithm, *overrides = run.variant.split("+")
    config = REPO / "configs" / f"fmnist_htcnn8_{algorithm}_{run.partition}.yaml"
    if not config.exists():
        sys.exit(f"bench: no config {config.relative_to(REPO)} for algorithm '{algorithm}'")
    return config, [f"rounds={args.rounds}", f"seed={run.seed}", f"runtime.threads={args.threads}",
                    "checkpoint_every=10", "checkpoint_keep=1", *args.set, *overrides]


def command(run: Run, args: argparse.Namespace) -> list[str]:
    config, overrides = config_and_overrides(run, args)
    program = ["-m", "htfl_dist.main", "--config", str(config), "--out", str(run.out), "--resume", "auto",
               *overrides]
    if args.nproc == 1:
        return [sys.executable, *program]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", *program]


def finished(run: Run, args: argparse.Namespace) -> bool:
    """A finished run of this very experiment is read back. A summary of another experiment (the
    config file changed since, e.g. a paper-table setting) stops the benchmark instead of being
    reported under this run's name."""
    summary = read_summary(run.out)
    if summary is None:
        return False
    config, overrides = config_and_overrides(run, args)
    expected = resolved_config(str(config), overrides).config_hash()
    if summary.get("config_hash") != expected:
        sys.exit(f"bench: {run.out} holds a run of another experiment (config hash "
                 f"{summary.get('config_hash')}, this config gives {expected}); move it away or pass another --out")
    return summary.get("rounds", 0) >= args.rounds


def execute(runs: list[Run], args: argparse.Namespace) -> None:
    """Launch up to ``--jobs`` runs at once; a failed run stops the benchmark with its log named.

    Whatever ends the loop (a failed run, Ctrl-C, an error) first stops the runs still going,
    so none is left training unattended; they resume from their checkpoints next time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    pending = [run for run in runs if not finished(run, args)]
    active: list[tuple[Run, subprocess.Popen, object]] = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        while pending or active:
            while pending and len(active) < args.jobs:
                run = pending.pop(0)
                cmd = command(run, args)
                print("launch:", " ".join(cmd), flush=True)
                log = open(run.out.parent / f"{run.out.name}.log", "a")  # noqa: SIM115 (closed when the run ends)
                active.append((run, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                               log))
            time.sleep(2)
            for entry in list(active):
                run, process, log = entry
                if process.poll() is None:
                    continue
                log.close()
                active.remove(entry)
                if process.returncode != 0:
                    sys.exit(f"bench: {run.out.name} failed with exit code {process.returncode}; see {log.name}")
                print(f"done: {run.out.name}", flush=True)
    finally:
        stop(active)


def stop(active: list[tuple[Run, subprocess.Popen, object]], grace_s: float = 10.0) -> None:
    """Terminate every still-running process, give each ``grace_s`` to exit (torchrun passes
    SIGTERM on to its ranks), then kill the ones that did not; close their logs."""
    for _, process, _ in active:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for _, process, log in active:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


REPORTED = ("best_test_acc", "best_round", "last_test_acc", "best_test_acc_head", "seconds_per_round", "server_s",
            "bytes_up_per_round", "max_bytes_up_over_theory", "bytes_down_per_round",
            "bytes_theory_down_per_round")  # of htfl_dist.metrics.report.summarise


def report(run: Run) -> dict:
    record = read_run(run.out)
    summary = summarise(record)
    return {"variant": run.variant, "partition": run.partition, "seed": run.seed,
            **{key: summary[key] for key in REPORTED}, "rounds": len(record.rows)}


def mean_std(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values) * scale:.{digits}f} ± {spread * scale:.{digits}f}"


def print_tables(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nFMNIST HtCNN8, 20 clients, {args.rounds} rounds, {args.nproc} rank(s), overrides: {args.set or 'none'}")
    per_run = []
    for r in results:
        ratio = f"{r['max_bytes_up_over_theory']:.4f}" if r["max_bytes_up_over_theory"] else "-"
        per_run.append([r["variant"], r["partition"], r["seed"], f"{r['best_test_acc'] * 100:.2f} ({r['best_round']})",
                        f"{r['last_test_acc'] * 100:.2f}", f"{r['best_test_acc_head'] * 100:.2f}",
                        f"{r['seconds_per_round']:.2f}", f"{r['server_s']:.3f}", ratio])
    print(markdown_table(["variant", "partition", "seed", "best acc (round)", "last acc", "best head acc",
                          "s/round", "server s/round", "up/theory"], per_run))
    print()
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["variant"], r["partition"]), []).append(r)
    per_group = []
    for (variant, partition), group in groups.items():
        seconds = statistics.fmean(r["seconds_per_round"] for r in group)
        server = statistics.fmean(r["server_s"] for r in group)
        ratios = [r["max_bytes_up_over_theory"] for r in group if r["max_bytes_up_over_theory"]]
        ratio = f"{max(ratios):.4f}" if ratios else "-"
        per_group.append([variant, partition, len(group), mean_std([r["best_test_acc"] for r in group], 100),
                          mean_std([r["last_test_acc"] for r in group], 100), f"{seconds:.2f}",
                          f"{server:.3f} ({server / seconds * 100:.1f} %)",
                          f"{statistics.fmean(r['bytes_up_per_round'] for r in group) / 1e6:.3f} MB", ratio,
                          f"{statistics.fmean(r['bytes_down_per_round'] for r in group) / 1e6:.3f} / "
                          f"{statistics.fmean(r['bytes_theory_down_per_round'] for r in group) / 1e6:.3f} MB"])
    print(markdown_table(["variant", "partition", "seeds", "best acc %", "last acc %", "s/round",
                          "server s/round (share)", "bytes up/round", "up/theory",
                          "down/round: sent (one broadcast per client rank) / theory (per client)"], per_group))


def main() -> int:
    args = parse_args()
    runs = plan(args)
    execute(runs, args)
    results = [report(run) for run in sorted(runs, key=lambda run: (run.variant, run.partition, run.seed))]
    print_tables(results, args)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
