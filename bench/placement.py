"""Benchmark: how evenly each placement spreads the clients' work over the client ranks.

Part 1 (no training, seconds): for the partition a config makes, the training samples each
client rank gets under ``round_robin`` and ``balanced`` (longest processing time first), for 1..7
client ranks. The projected speed-up over one process is total work / the busiest rank's work:
the round waits for the slowest rank, and local training is linear in the samples.

Part 2 (``--measure``): real runs, one process vs ``torchrun`` with 2 client ranks under each
placement, one thread per rank. It prints s/round, the speed-up, and the mean idle share of each
client rank (``rank_idle_share`` in metrics.jsonl). This needs 3 free cores to mean anything.

    python bench/placement.py                                      # FMNIST Dirichlet 0.1, 20 clients
    python bench/placement.py --set data.partition=pathological
    python bench/placement.py --measure --rounds 3 --set data.subsample=0.2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from htfl_dist.config import load_config
from htfl_dist.data import prepare_partition
from htfl_dist.metrics.report import markdown_table
from htfl_dist.runtime.placement import PLACEMENTS, plan_placement

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "fmnist_htcnn8_fedproto_dirichlet.yaml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="config overrides")
    parser.add_argument("--max-ranks", type=int, default=7, help="largest number of client ranks projected")
    parser.add_argument("--measure", action="store_true", help="also time real runs (1 process, torchrun 3)")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def projection(work: list[float], max_ranks: int) -> list[list[str]]:
    rows = []
    total = sum(work)
    for client_ranks in range(1, max_ranks + 1):
        row = [str(client_ranks)]
        for policy in PLACEMENTS:
            placement = plan_placement(policy, client_ranks + 1, work)
            loads = [sum(work[c] for c in placement.clients_of(rank)) for rank in range(1, client_ranks + 1)]
            busiest = max(loads)
            idle = statistics.fmean((busiest - load) / busiest for load in loads)
            row += [f"{total / busiest:.2f}x", f"{idle:.1%}"]
        rows.append(row)
    return rows


def timed_run(args: argparse.Namespace, out: Path, nproc: int, placement: str) -> dict:
    program = ["-m", "htfl_dist.main", "--config", args.config, "--out", str(out), f"rounds={args.rounds}",
               "runtime.threads=1", f"runtime.placement={placement}", *args.set]
    if nproc == 1:
        command = [sys.executable, *program]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
                   *program]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench: run failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = rows[1:] or rows  # round 1 carries start-up effects (first download, caches)
    idle = [statistics.fmean(shares) for shares in zip(*(r["rank_idle_share"] for r in timed), strict=True)]
    return {"seconds": statistics.fmean(r["seconds"] for r in timed), "idle": idle,
            "accuracy": rows[-1]["test_acc"]}


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        single = timed_run(args, Path(scratch) / "single", 1, "balanced")
        rows = [["1 process", f"{single['seconds']:.2f}", "1.00x", "-", f"{single['accuracy']:.4f}"]]
        for policy in PLACEMENTS:
            result = timed_run(args, Path(scratch) / policy, 3, policy)
            idle = ", ".join(f"{share:.1%}" for share in result["idle"])
            rows.append([f"torchrun 3 ({policy})", f"{result['seconds']:.2f}",
                         f"{single['seconds'] / result['seconds']:.2f}x", idle, f"{result['accuracy']:.4f}"])
    print(markdown_table(["run", "s/round (rounds 2+)", "speed-up", "idle share per client rank",
                          "last test_acc"], rows))


def main() -> int:
    args = parse_args()
    config = load_config(args.config, args.set)
    info = prepare_partition(config.data, config.num_clients, config.seed)
    work = [float(n) for n in info.class_counts.sum(axis=1)]
    print(f"{config.data.dataset} {config.data.partition}, {config.num_clients} clients, training samples per "
          f"client: min {min(work):.0f}, median {statistics.median(work):.0f}, max {max(work):.0f}")
    headers = ["client ranks"]
    for policy in PLACEMENTS:
        headers += [f"{policy}: projected speed-up", f"{policy}: mean idle"]
    print(markdown_table(headers, projection(work, args.max_ranks)))
    if args.measure:
        print()
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
