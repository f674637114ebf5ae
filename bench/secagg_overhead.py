"""What secure aggregation adds to a round (issue 48 item 5): FedProto on Fashion-MNIST, plain
against ``privacy.secure_aggregation=true`` (SecAgg, every pair; and SecAgg+ with a ring of k
neighbours), paired in one invocation on one machine, one process each (``runtime.simulate``: the
program's own loop and exchange, rank 0 relaying the protocol to itself).

Per federation (N clients at join ratio ρ) and mode: seconds a round (median of the rounds after
the first), bytes up a round, the last round's test accuracy, and its difference from plain (the
quantisation's effect; the runs share the split, the seeds and the drop-outs). The data are
subsampled (``--subsample``) so that a 1,000-client federation fits a 2-core machine; the protocol's
cost depends on the participants and the vector length (C·K + C), not on the samples.

    python bench/secagg_overhead.py --out secagg.json
    python bench/secagg_overhead.py --federations 20:1.0 --rounds 3 --neighbours 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from htfl_dist.runtime.simulate import simulate  # noqa: E402

SMOKE = REPO / "configs" / "smoke.yaml"


def federations(text: str) -> list[tuple[int, float]]:
    pairs = []
    for item in text.split(","):
        clients, _, ratio = item.partition(":")
        pairs.append((int(clients), float(ratio or 1.0)))
    return pairs


def play(work: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    began = time.perf_counter()
    rows = simulate(SMOKE, overrides, out=work / name)
    wall = time.perf_counter() - began
    timed = [row["seconds"] for row in rows[1:]] or [rows[0]["seconds"]]
    return {"s_per_round": statistics.median(timed), "bytes_up": statistics.median(row["bytes_up"] for row in rows),
            "last_acc": rows[-1]["test_acc"], "clipped": sum(row.get("secagg_clipped", 0) for row in rows),
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--federations", default="20:1.0,100:1.0,1000:0.1", help="N:rho,... (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--subsample", type=float, default=0.1)
    parser.add_argument("--neighbours", type=int, default=10, help="k of the SecAgg+ ring")
    parser.add_argument("--cache-dir", default=None, help="partition caches (default: the user's cache)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (e.g. data.beta=0.5: Dirichlet 0.1 cannot give "
                             "1,000 clients 10 samples each)")
    args = parser.parse_args(argv)
    report: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for clients, ratio in federations(args.federations):
            base = [f"num_clients={clients}", f"join_ratio={ratio}", f"rounds={args.rounds}",
                    f"data.subsample={args.subsample}", "data.min_samples_per_client=10", "checkpoint_every=0",
                    "eval.clients_fraction=" + ("0.1" if clients >= 500 else "1.0"), *args.set]
            if args.cache_dir:
                base.append(f"data.cache_dir={args.cache_dir}")
            modes = {"plain": [], "secagg": ["privacy.secure_aggregation=true"],
                     f"secagg+ k={args.neighbours}": ["privacy.secure_aggregation=true",
                                                      f"privacy.secagg_neighbours={args.neighbours}"]}
            results = {}
            for mode, extra in modes.items():
                try:
                    results[mode] = play(work, f"{clients}-{mode.split()[0]}", base + extra)
                except Exception as exc:  # a federation the data cannot split: say so, go on
                    print(f"[{clients} clients, {mode}] failed: {exc}", flush=True)
            if "plain" not in results:
                continue
            plain = results["plain"]
            for mode, result in results.items():
                result.update(clients=clients, join_ratio=ratio, mode=mode,
                              time_ratio=result["s_per_round"] / plain["s_per_round"],
                              bytes_ratio=result["bytes_up"] / plain["bytes_up"],
                              acc_difference=result["last_acc"] - plain["last_acc"])
                report.append(result)
    print(f"{'clients':>8} {'rho':>5} {'mode':>14} {'s/round':>8} {'x plain':>8} {'bytes up':>12} {'x plain':>8} "
          f"{'last acc':>9} {'diff':>7} {'clipped':>8}")
    for r in report:
        print(f"{r['clients']:>8} {r['join_ratio']:>5} {r['mode']:>14} {r['s_per_round']:8.2f} {r['time_ratio']:8.2f} "
              f"{r['bytes_up']:12.0f} {r['bytes_ratio']:8.2f} {r['last_acc']:9.4f} {r['acc_difference']:+7.4f} "
              f"{r['clipped']:8d}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
