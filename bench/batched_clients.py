"""Benchmark: one local epoch of every client, one by one (``ClientAlgorithm.train``) against
``train.client_batching=vmap`` (``ClientAlgorithm.train_group``: each architecture's clients as one
batched model), on a config's partition (configs/fmnist_htcnn8_<algorithm>_dirichlet.yaml by default: FMNIST,
Dirichlet 0.1, HtCNN8), one thread.

For each number of clients (``--num-clients``, default 20 and 100: 2-3 and 12-13 clients per
HtCNN8 architecture), it prints per architecture and in total the seconds of both and the
speed-up. The two alternate ``--repeats`` times and the fastest of each counts, so background
load hurts both the same way. Both run on the same models (timing only: the batched path's
equality is tests/algorithms/test_client_batching.py's business).

    python bench/batched_clients.py
    python bench/batched_clients.py --num-clients 20 --algorithm fedproto --device cuda
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_clients import build_client, client_algorithm

from htfl_dist.algorithms import ClientState
from htfl_dist.config import load_config
from htfl_dist.data import prepare_partition
from htfl_dist.metrics.report import markdown_table
from htfl_dist.seeding import torch_generator

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="default: configs/fmnist_htcnn8_<algorithm>_dirichlet.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value")
    parser.add_argument("--algorithm", default="local")
    parser.add_argument("--num-clients", nargs="*", type=int, default=[20, 100])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def build_clients(config, info, algorithm, device: torch.device) -> dict[str, list[ClientState]]:
    """Every client of the partition, grouped by architecture (what one rank hosting all would group)."""
    groups: dict[str, list[ClientState]] = {}
    for client_id in range(config.num_clients):
        client = build_client(config, info, client_id, device, algorithm)
        groups.setdefault(client.architecture, []).append(client)
    return groups


def timed(work, device: torch.device) -> float:
    began = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def measure(algorithm, clients: list[ClientState], knowledge: dict, repeats: int,
            device: torch.device) -> tuple[float, float]:
    """(one by one, batched) seconds of one local epoch of ``clients``, the fastest of ``repeats``."""
    def generators() -> list[torch.Generator]:
        return [torch_generator(0, "bench", client.client_id) for client in clients]

    def one_by_one() -> None:
        for client, generator in zip(clients, generators(), strict=True):
            algorithm.train(client, knowledge, 0, generator)

    def batched() -> None:
        algorithm.train_group(clients, knowledge, 0, generators())

    alone, grouped = [], []
    for _ in range(repeats):
        alone.append(timed(one_by_one, device))
        grouped.append(timed(batched, device))
    return min(alone), min(grouped)


def run(args: argparse.Namespace, num_clients: int) -> None:
    device = torch.device(args.device)
    path = args.config or REPO / "configs" / f"fmnist_htcnn8_{args.algorithm}_dirichlet.yaml"
    config = load_config(path, [f"algorithm={args.algorithm}", f"num_clients={num_clients}",
                                "train.client_batching=vmap", *args.set])
    info = prepare_partition(config.data, config.num_clients, config.seed, batch_size=config.train.batch_size)
    algorithm, empty = client_algorithm(config, info, device)
    rows, total_alone, total_grouped, total_samples = [], 0.0, 0.0, 0
    for architecture, clients in sorted(build_clients(config, info, algorithm, device).items()):
        alone, grouped = measure(algorithm, clients, empty, args.repeats, device)
        samples = sum(client.train_y.shape[0] for client in clients)
        rows.append([architecture, len(clients), samples, f"{alone:.2f}", f"{grouped:.2f}", f"{alone / grouped:.2f}x"])
        total_alone, total_grouped = total_alone + alone, total_grouped + grouped
        total_samples += samples
        print(f"{num_clients} clients, {architecture}: one by one {alone:.2f}s, vmap {grouped:.2f}s",
              file=sys.stderr, flush=True)
    rows.append(["all", num_clients, total_samples, f"{total_alone:.2f}", f"{total_grouped:.2f}",
                 f"{total_alone / total_grouped:.2f}x"])
    print(f"\n{config.data.dataset} {config.data.partition}, {num_clients} {config.model.group} clients, batch "
          f"{config.train.batch_size}, algorithm {config.algorithm}, {device}, {torch.get_num_threads()} thread(s), "
          f"one local epoch, fastest of {args.repeats}")
    print(markdown_table(["architecture", "clients", "train samples", "one by one s", "vmap s", "speed-up"], rows))


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    for num_clients in args.num_clients:
        run(args, num_clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
