"""Benchmark: algorithms side by side on one setting; prints best accuracy and seconds per round.

Default (the foundation issue's check): FedProto vs Local on Fashion-MNIST, 20 HtCNN8
clients, Dirichlet β=0.1, 50 rounds, each launched with torchrun (rank 0 server).

    python bench/compare_algorithms.py                       # both, one after the other
    python bench/compare_algorithms.py --parallel --nproc 5  # both at once (GPU box)
    python bench/compare_algorithms.py --rounds 5 --set data.subsample=0.1   # a quick look

Every run writes its usual run directory under --out; this script only launches and reads.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["fedproto", "local"],
                        help="algorithm names, each optionally with +key=value overrides")
    parser.add_argument("--partition", default="dirichlet", choices=("dirichlet", "pathological"))
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (1 = single process)")
    parser.add_argument("--parallel", action="store_true", help="launch all algorithms at once")
    parser.add_argument("--out", default=str(REPO / "runs" / "bench"))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="extra config overrides")
    return parser.parse_args()


def command(variant: str, args: argparse.Namespace, out: Path) -> list[str]:
    """``variant`` is an algorithm name, optionally with overrides: ``fedproto+algo.client_reg=htfllib``."""
    algorithm, *overrides = variant.split("+")
    config = REPO / "configs" / f"fmnist_htcnn8_{algorithm}_{args.partition}.yaml"
    program = ["-m", "htfl_dist.main", "--config", str(config), "--out", str(out),
               f"rounds={args.rounds}", "checkpoint_every=0", *args.set, *overrides]
    if args.nproc == 1:
        return [sys.executable, *program]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", *program]


def report(algorithm: str, out: Path, wall: float) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    ratio_up = [r["bytes_up"] / r["bytes_theory_up"] for r in rows if r["bytes_theory_up"]]
    return {
        "algorithm": algorithm,
        "best_test_acc": summary["best_test_acc"],
        "best_round": summary["best_round"],
        "last_test_acc": summary["last_test_acc"],
        "best_test_acc_head": max(r["test_acc_head"] for r in rows),
        "seconds_per_round": summary["seconds_per_round"],
        "client_s": sum(r["client_s"] for r in rows) / len(rows),
        "server_s": sum(r["server_s"] for r in rows) / len(rows),
        "comm_s": sum(r["comm_s"] for r in rows) / len(rows),
        "max_bytes_up_over_theory": max(ratio_up) if ratio_up else None,
        "device": summary["device"],
        "world_size": summary["world_size"],
        "wall_s": wall,
    }


def main() -> int:
    args = parse_args()
    root = Path(args.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    runs = []
    for algorithm in args.algorithms:
        label = algorithm.replace("+", "_").replace("=", "-").replace("algo.", "")
        out = root / f"{label}-{args.partition}-{stamp}"
        runs.append((algorithm, out, command(algorithm, args, out)))
    results, started = [], {}
    processes = []
    root.mkdir(parents=True, exist_ok=True)
    for algorithm, out, cmd in runs:
        print("launch:", " ".join(cmd), flush=True)
        started[algorithm] = time.perf_counter()
        log = open(root / f"{out.name}.log", "w")
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        processes.append((algorithm, out, process, log))
        if not args.parallel:
            process.wait()
    for algorithm, out, process, log in processes:
        code = process.wait()
        log.close()
        wall = time.perf_counter() - started[algorithm]
        if code != 0:
            print(f"{algorithm}: failed with exit code {code}; see {log.name}", file=sys.stderr)
            return code
        results.append(report(algorithm, out, wall))
    print(f"\nFMNIST HtCNN8, 20 clients, {args.partition}, {args.rounds} rounds, {args.nproc} rank(s)")
    print(f"{'algorithm':30s} {'best acc':>9s} {'round':>5s} {'last acc':>9s} {'head best':>9s} "
          f"{'s/round':>8s} {'client_s':>8s} {'server_s':>8s} {'comm_s':>7s} {'up/theory':>9s}  device")
    for r in results:
        ratio = f"{r['max_bytes_up_over_theory']:.4f}" if r["max_bytes_up_over_theory"] else "-"
        print(f"{r['algorithm']:30s} {r['best_test_acc'] * 100:8.2f}% {r['best_round']:5d} "
              f"{r['last_test_acc'] * 100:8.2f}% {r['best_test_acc_head'] * 100:8.2f}% "
              f"{r['seconds_per_round']:8.2f} {r['client_s']:8.2f} {r['server_s']:8.4f} {r['comm_s']:7.2f} "
              f"{ratio:>9s}  {r['device']} x{r['world_size']}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
