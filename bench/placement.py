"""Benchmark: how evenly each placement spreads the clients' work over the client ranks.

Part 1 (no training, seconds): for the partition a config makes, the training samples each
client rank gets under ``round_robin`` and ``balanced`` (longest processing time first), for 1..7
client ranks. The projected speed-up over one process is total work / the busiest rank's work:
the round waits for the slowest rank, and local training is linear in the samples.

Part 2 (``--measure``): real runs, one process vs ``torchrun`` with 1 client rank and with 2 client
ranks under each placement, one thread per rank. It prints s/round, the speed-up, the speed-up
per client rank (the issue's bar is 0.95), and the mean idle share of each client rank
(``rank_idle_share`` in metrics.jsonl). Rank 0 (the server) mostly waits, so 2 free cores carry
2 client ranks.

Part 3 (``--timed-costs``): one local epoch of every client is timed (the config's algorithm,
``ClientAlgorithm.train``, one thread, fastest of ``--repeats``), and the projection is made again
from these measured costs. Each placement is planned from its estimate (samples; samples x FLOPs
per sample; or timed: local steps x one step of the member, as rank 0 times it at start-up), and
a rank's load is the measured seconds of the clients it got. "measured" is the same LPT planned
from the measured costs themselves: the best any estimate could do.

    python bench/placement.py                                      # FMNIST Dirichlet 0.1, 20 clients
    python bench/placement.py --set data.partition=pathological
    python bench/placement.py --timed-costs
    python bench/placement.py --measure --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_clients import build_client, client_algorithm, run_program

from htfl_dist.config import load_config
from htfl_dist.data import prepare_partition
from htfl_dist.metrics.report import markdown_table
from htfl_dist.models import members_in_use
from htfl_dist.models.cost import timed_step_seconds
from htfl_dist.runtime.placement import (
    PLACEMENTS,
    Placement,
    client_ranks,
    estimated_client_work,
    idle_shares,
    plan_placement,
)
from htfl_dist.seeding import torch_generator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "fmnist_htcnn8_fedproto_dirichlet.yaml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value", help="config overrides")
    parser.add_argument("--max-ranks", type=int, default=7, help="largest number of client ranks projected")
    parser.add_argument("--measure", action="store_true", help="also time real runs (1 process, torchrun 3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timed-costs", action="store_true",
                        help="time every client's local epoch and project from those costs")
    parser.add_argument("--repeats", type=int, default=1, help="--timed-costs: fastest of this many epochs")
    return parser.parse_args()


def projected(placement: Placement, costs: list[float]) -> tuple[float, float]:
    """(speed-up over one process, mean idle share of the client ranks) if the clients cost
    ``costs``: the round waits for the busiest rank."""
    loads = [sum(costs[c] for c in placement.clients_of(rank)) for rank in client_ranks(placement.world_size)]
    return sum(costs) / max(loads), statistics.fmean(idle_shares(loads))


def projection(work: list[float], max_ranks: int) -> list[list[str]]:
    rows = []
    for ranks in range(1, max_ranks + 1):
        row = [str(ranks)]
        for policy in PLACEMENTS:
            speedup, idle = projected(plan_placement(policy, ranks + 1, work), work)
            row += [f"{speedup:.2f}x", f"{idle:.1%}"]
        rows.append(row)
    return rows


def timed_client_epochs(config, info, repeats: int) -> list[float]:
    """Seconds of one local epoch of every client (fastest of ``repeats``), one thread, on the CPU."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    algorithm, knowledge = client_algorithm(config, info, device)
    seconds = []
    for client_id in range(config.num_clients):
        client = build_client(config, info, client_id, device, algorithm)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            algorithm.train(client, knowledge, 0, torch_generator(config.seed, "bench", client_id))
            times.append(time.perf_counter() - began)
        seconds.append(min(times))
        print(f"client {client_id}: {client.architecture}, {client.train_y.shape[0]} samples, {seconds[-1]:.2f}s",
              file=sys.stderr, flush=True)
    return seconds


def projection_from_costs(args: argparse.Namespace, config, info) -> None:
    costs = timed_client_epochs(config, info, args.repeats)
    step_seconds = timed_step_seconds(  # what rank 0 measures for placement_work=timed
        members_in_use(config.model.group, config.num_clients), num_classes=info.num_classes,
        feature_dim=config.model.feature_dim, in_channels=info.in_channels, image_size=info.image_size,
        batch_size=config.train.batch_size, device=torch.device("cpu"))
    estimates = {basis: estimated_client_work(load_config(args.config, [*args.set, f"runtime.placement_work={basis}"]),
                                              info, step_seconds)[0] for basis in ("samples", "flops", "timed")}
    plans = [("round_robin", "samples"), ("balanced", "samples"), ("balanced", "flops"), ("balanced", "timed"),
             ("balanced", "measured")]
    rows = []
    for ranks in range(1, args.max_ranks + 1):
        row = [str(ranks)]
        for policy, basis in plans:
            speedup, idle = projected(plan_placement(policy, ranks + 1, estimates.get(basis, costs)), costs)
            row.append(f"{speedup:.2f}x ({idle:.1%} idle)")
        rows.append(row)
    total = sum(costs)
    print(f"\nmeasured epoch of every client, one thread: total {total:.1f}s, min {min(costs):.2f}s, "
          f"max {max(costs):.2f}s; projected speed-up (mean idle share of the client ranks)")
    print(markdown_table(["client ranks", *(f"{policy} by {basis}" for policy, basis in plans)], rows))


def timed_run(args: argparse.Namespace, out: Path, nproc: int, placement: str, work: str) -> dict:
    rows = run_program(args.config, out, [f"rounds={args.rounds}", f"runtime.placement={placement}",
                                          f"runtime.placement_work={work}", *args.set], nproc)
    timed = rows[1:] or rows  # round 1 carries start-up effects (first download, caches)
    idle = [statistics.fmean(shares) for shares in zip(*(r["rank_idle_share"] for r in timed), strict=True)]
    return {"seconds": statistics.fmean(r["seconds"] for r in timed), "idle": idle,
            "accuracy": rows[-1]["test_acc"]}


MEASURED_RUNS = [(2, "balanced", "timed"), (3, "balanced", "timed"), (3, "balanced", "samples"),
                 (3, "round_robin", "samples")]
"""(ranks, runtime.placement, runtime.placement_work) of the torchrun runs, after one process."""


def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        single = timed_run(args, Path(scratch) / "single", 1, "balanced", "samples")
        rows = [["1 process", "-", f"{single['seconds']:.2f}", "1.00x", "-", "-", f"{single['accuracy']:.4f}"]]
        for nproc, policy, work in MEASURED_RUNS:
            result = timed_run(args, Path(scratch) / f"{nproc}-{policy}-{work}", nproc, policy, work)
            idle = ", ".join(f"{share:.1%}" for share in result["idle"])
            speedup = single["seconds"] / result["seconds"]
            name = f"torchrun {nproc} ({policy}" + (f" by {work})" if policy == "balanced" else ")")
            rows.append([name, str(nproc - 1), f"{result['seconds']:.2f}", f"{speedup:.2f}x",
                         f"{speedup / (nproc - 1):.3f}", idle, f"{result['accuracy']:.4f}"])
    print(markdown_table(["run", "client ranks", "s/round (rounds 2+)", "speed-up", "per client rank",
                          "idle share per client rank", "last test_acc"], rows))


def main() -> int:
    args = parse_args()
    config = load_config(args.config, args.set)
    info = prepare_partition(config.data, config.num_clients, config.seed, batch_size=config.train.batch_size)
    work = [float(n) for n in info.class_counts.sum(axis=1)]
    print(f"{config.data.dataset} {config.data.partition}, {config.num_clients} clients, training samples per "
          f"client: min {min(work):.0f}, median {statistics.median(work):.0f}, max {max(work):.0f}")
    headers = ["client ranks"]
    for policy in PLACEMENTS:
        headers += [f"{policy}: projected speed-up", f"{policy}: mean idle"]
    print(markdown_table(headers, projection(work, args.max_ranks)))
    if args.timed_costs:
        projection_from_costs(args, config, info)
    if args.measure:
        print()
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
