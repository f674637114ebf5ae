"""Benchmark: many logical clients on one process, with and without a bound on resident clients.

For each number of clients N and each ``runtime.resident_clients`` value, one real run of the
program (one process, one thread) on FMNIST with join ratio ρ: it prints the peak resident set
size, the start-up time, the mean time of a training round (no evaluation in it) and the time
of the one evaluation round (the last: every client evaluated). A bounded store should keep the
peak RSS flat in N and the training round linear in the participants (ρ·N), not in N.

    python bench/many_clients.py                                   # N = 100, 300, 1000; all vs 64 resident
    python bench/many_clients.py --clients 1000 --resident 64 --rounds 4
    python bench/many_clients.py --set data.partition=iid
    python bench/many_clients.py --clients 10000 --resident 64 --join-ratio 0.01 --rounds 2 \
        --set eval.clients_fraction=0.01 data.partition_rules=legacy data.min_samples_per_client=4

The partition is PFLlib's pathological one (2 classes per client): Dirichlet 0.1 with 1000
clients cannot meet PFLlib's minimum client size and would redraw without end. At 10,000 clients
(7 FMNIST samples each) PFLlib's pathological rule leaves a client empty; the legacy rules with a
floor of 4 samples give every client a training sample.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from htfl_dist.metrics.report import markdown_table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "fmnist_htcnn8_fedproto_pathological.yaml"
CHILD_FLAG = "--one-run"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--resident", type=int, nargs="+", default=[0, 64],
                        help="runtime.resident_clients values (0 = all resident)")
    parser.add_argument("--join-ratio", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=3, help="the last one is the evaluation round")
    parser.add_argument("--algorithm", default="fedproto")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more config overrides")
    return parser.parse_args()


def one_run(argv: list[str]) -> None:
    """Child process: run the program in-process, then print its own peak RSS (the parent's
    RUSAGE_CHILDREN would be the maximum over every run so far)."""
    from htfl_dist.main import main

    began = time.perf_counter()
    try:
        status = main(argv)
    finally:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"BENCH peak_rss_kib={peak_kib} wall_s={time.perf_counter() - began:.2f}", flush=True)
    sys.exit(status)  # a failed run is reported as one, with its line


def measure(args: argparse.Namespace, clients: int, resident: int, out: Path, cache: Path) -> list[str]:
    overrides = [f"algorithm={args.algorithm}", f"num_clients={clients}", f"join_ratio={args.join_ratio}",
                 f"rounds={args.rounds}", f"eval_every={args.rounds}", "checkpoint_every=0",
                 "data.partition=pathological", "runtime.threads=1", f"runtime.resident_clients={resident}",
                 f"data.cache_dir={cache}", "output.progress_every_s=0", *args.set]
    command = [sys.executable, __file__, CHILD_FLAG, "--config", args.config, "--out", str(out), *overrides]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        return [str(clients), str(resident), f"failed: {result.stderr.strip().splitlines()[-1]}", "", "", "", ""]
    stats = dict(re.findall(r"(\w+)=([\d.]+)", result.stdout.split("BENCH", 1)[1]))
    startup = re.search(r"start-up: .*\(([\d.]+)s\)", result.stdout + result.stderr)
    summary = json.loads((out / "summary.json").read_text())
    eval_row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    total = summary["seconds_per_round"] * args.rounds
    training_round = (total - eval_row["seconds"]) / max(args.rounds - 1, 1)
    return [str(clients), "all" if resident == 0 else str(resident),
            f"{int(stats['peak_rss_kib']) / 2**20:.2f} GiB", startup.group(1) + " s" if startup else "?",
            f"{training_round:.2f} s", f"{eval_row['seconds']:.2f} s", f"{eval_row['test_acc']:.4f}"]


def main() -> None:
    if sys.argv[1:2] == [CHILD_FLAG]:
        one_run(sys.argv[2:])
        return
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "cache"
        for clients in args.clients:
            for resident in args.resident:
                rows.append(measure(args, clients, resident, Path(scratch) / f"n{clients}-r{resident}", cache))
                print(" | ".join(rows[-1]), flush=True)
    print(markdown_table(["clients", "resident", "peak RSS", "start-up", "training round", "evaluation round",
                          "test_acc"], rows))


if __name__ == "__main__":
    main()
