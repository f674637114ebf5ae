"""Utility against ε under ``privacy.*`` (docs/privacy.md): FedProto and FedTGP on the smoke config
(FMNIST, 2 % of the data, 6 HtCNN8 clients, Dirichlet β = 0.1) at ε ∈ {1, 4, 8, ∞}, δ = 1e-5,
several seeds, in this process (``htfl_dist.runtime.simulate``, the program's own round loop).

    python bench/privacy_utility.py --out runs/privacy_bench              # runs the grid, prints the table
    python3 bench/privacy_utility.py --out runs/privacy_bench --plot-only  # table + bench/privacy_utility.png

Each cell is an ordinary run directory ``OUT/<algorithm>-eps<E>-seed<S>`` with its final
checkpoint and prototype snapshot kept (``bench/privacy_membership.py`` attacks those); a cell
whose metrics are complete is not run again. The private cells draw their noise as the config's
default ``privacy.noise`` says (``secure``: the OS's secret source, so they differ from run to run);
the table's "noise" column is each cell's mode, read from its summary.json. A private client keeps
its training loss to itself (metrics.jsonl's ``train_loss`` is null), so the loss column shows
"withheld" for private cells. ``--plot-only`` needs matplotlib and nothing else
(no torch), so it runs under any Python that has it.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
EPSILONS = ("inf", "8", "4", "1")


def cell_dir(out: Path, algorithm: str, epsilon: str, seed: int) -> Path:
    return out / f"{algorithm}-eps{epsilon}-seed{seed}"


def cell_overrides(algorithm: str, epsilon: str, seed: int, rounds: int, cache_dir: Path) -> list[str]:
    """The run's dotted overrides of the smoke config: ε = inf is privacy off."""
    overrides = [f"algorithm={algorithm}", f"rounds={rounds}", f"seed={seed}", f"data.cache_dir={cache_dir}",
                 f"checkpoint_every={rounds}", f"output.prototypes_every={rounds}"]
    if epsilon != "inf":
        overrides += ["privacy.enabled=true", f"privacy.target_epsilon={epsilon}", "privacy.delta=1e-5"]
    return overrides


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cell(out: Path, algorithm: str, epsilon: str, seed: int, rounds: int, cache_dir: Path) -> Path:
    """Play one cell unless its metrics already hold every round; returns its run directory."""
    from htfl_dist.runtime.simulate import simulate  # torch: only where runs are played

    run_dir = cell_dir(out, algorithm, epsilon, seed)
    if len(read_rows(run_dir)) == rounds:
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)  # a cell cut off half-way starts again
    simulate(SMOKE, cell_overrides(algorithm, epsilon, seed, rounds, cache_dir), out=run_dir)
    return run_dir


def cell_result(run_dir: Path) -> dict:
    """One cell's figures. ``train_loss`` is None where the run did not report it (a private run's
    clients withhold it: ``withheld`` says so); ``noise`` is the private run's ``privacy.noise``
    (None with privacy off)."""
    rows = read_rows(run_dir)
    last = rows[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    privacy = summary.get("privacy") or {}
    return {"proto_last": last["test_acc"], "proto_best": max(r["test_acc"] for r in rows),
            "head_last": last["test_acc_head"], "train_loss": last.get("train_loss"),
            "withheld": "train_loss" in (privacy.get("withheld") or {}),
            "epsilon_max": last.get("epsilon_max"), "sigma": privacy.get("noise_multiplier"),
            "noise": privacy.get("noise")}


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def _loss(cells: list[dict]) -> str:
    """The median last-round training loss over the cells that reported one; "withheld" where
    none did because the run is private, "–" where none did otherwise."""
    losses = [c["train_loss"] for c in cells if c["train_loss"] is not None]
    if not losses:
        return "withheld" if any(c["withheld"] for c in cells) else "–"
    text = f"{statistics.median(losses):.3g} (median)"
    return text if len(losses) == len(cells) else f"{text[:-1]} of {len(losses)}; rest withheld)"


def _noise(cells: list[dict]) -> str:
    """The cells' ``privacy.noise`` ("–" with privacy off; every mode present, if they differ)."""
    modes = sorted({c["noise"] for c in cells if c["noise"] is not None})
    return " + ".join(modes) if modes else "–"


def table(results: dict[tuple[str, str], list[dict]]) -> str:
    """Markdown: per (algorithm, ε) the mean ± sample std over seeds, accuracies in percent."""
    lines = ["| algorithm | ε (target) | noise | σ | ε spent, max | proto acc, last | proto acc, best "
             "| head acc, last | train loss, last | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (algorithm, epsilon), cells in results.items():
        sigma = cells[0]["sigma"]
        spent = [c["epsilon_max"] for c in cells if c["epsilon_max"] is not None]
        lines.append(
            f"| {algorithm} | {'∞' if epsilon == 'inf' else epsilon} | {_noise(cells)} "
            f"| {'–' if sigma is None else f'{sigma:.2f}'} "
            f"| {'–' if not spent else f'{max(spent):.3f}'} | {_mean_std([c['proto_last'] for c in cells])} "
            f"| {_mean_std([c['proto_best'] for c in cells])} | {_mean_std([c['head_last'] for c in cells])} "
            f"| {_loss(cells)} | {len(cells)} |")
    return "\n".join(lines)


def plot(results: dict[tuple[str, str], list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    positions = {epsilon: index for index, epsilon in enumerate(("1", "4", "8", "inf"))}
    for axis, (key, title) in zip(axes, (("proto_last", "prototype rule"), ("head_last", "client's own head")),
                                  strict=True):
        for algorithm in sorted({a for a, _ in results}):
            xs, means, stds = [], [], []
            for epsilon in sorted(positions, key=positions.get):
                cells = results.get((algorithm, epsilon))
                if not cells:
                    continue
                values = [100 * c[key] for c in cells]
                xs.append(positions[epsilon])
                means.append(statistics.mean(values))
                stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
            axis.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=algorithm)
        axis.set_xticks(range(4), ["1", "4", "8", "∞ (off)"])
        axis.set_xlabel("target ε (δ = 1e-5)")
        axis.set_title(f"test accuracy, {title}")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy, last round (%)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "privacy_bench")
    parser.add_argument("--algorithms", nargs="+", default=["fedproto", "fedtgp"])
    parser.add_argument("--epsilons", nargs="+", default=list(EPSILONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=None, help="partition cache (default: OUT/cache)")
    parser.add_argument("--plot-only", action="store_true", help="no runs: table and plot from OUT")
    parser.add_argument("--plot", type=Path, default=REPO / "bench" / "privacy_utility.png")
    args = parser.parse_args()
    cache_dir = args.cache_dir or args.out / "cache"
    results: dict[tuple[str, str], list[dict]] = {}
    for algorithm in args.algorithms:
        for epsilon in args.epsilons:
            for seed in args.seeds:
                if args.plot_only:
                    run_dir = cell_dir(args.out, algorithm, epsilon, seed)
                    if len(read_rows(run_dir)) != args.rounds:
                        continue
                else:
                    run_dir = run_cell(args.out, algorithm, epsilon, seed, args.rounds, cache_dir)
                result = cell_result(run_dir)
                results.setdefault((algorithm, epsilon), []).append(result)
                if not args.plot_only:
                    print(f"{algorithm} ε={epsilon} seed {seed}: proto {result['proto_last']:.4f} head "
                          f"{result['head_last']:.4f} ε spent {result['epsilon_max']} noise "
                          f"{result['noise'] or '–'}", flush=True)
    print(table(results))
    if args.plot_only:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    elif any(c["train_loss"] is not None and math.isnan(c["train_loss"]) for cells in results.values() for c in cells):
        print("note: some runs' training loss is NaN (diverged)")


if __name__ == "__main__":
    main()
