"""Benchmark: our client training path against a bare PyTorch loop doing the same work.

For each client of a config's partition (FMNIST Dirichlet 0.1, 20 HtCNN8 clients by default), one
local epoch two ways, alternating, ``--repeats`` times each, one thread:

- bare: the model, SGD, one ``randperm`` per epoch, batches by indexing, cross-entropy, written
  here with nothing else (the eager-PyTorch limit on this machine);
- ours: ``ClientAlgorithm.train`` of the chosen algorithm (``local`` by default: the same CE, plus
  whatever our loop adds: batch bookkeeping, the trailing-batch rule, loss accumulation;
  ``fedproto`` adds its prototype pass).

It prints samples/s of both and our overhead in % (the fastest repeat of each, so background load
hurts both the same way), per architecture and over all clients, plus the cost of evaluating every
client once (what every evaluated round adds) relative to its training epoch.

    python bench/client_throughput.py
    python bench/client_throughput.py --algorithm fedproto --clients 0 1 2 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from htfl_dist.algorithms import AlgorithmContext, ClientState, get_algorithm, parse_options
from htfl_dist.config import load_config
from htfl_dist.data import load_client_split, prepare_partition
from htfl_dist.metrics.report import markdown_table
from htfl_dist.models import architecture_for_client, initial_client_model
from htfl_dist.seeding import torch_generator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "fmnist_htcnn8_fedproto_dirichlet.yaml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value")
    parser.add_argument("--algorithm", default="local")
    parser.add_argument("--clients", nargs="*", type=int, help="client ids (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def bare_epoch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, lr: float,
               generator: torch.Generator) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    order = torch.randperm(y.shape[0], generator=generator)
    for start in range(0, y.shape[0], batch_size):
        index = order[start : start + batch_size]
        loss = F.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    model.eval()
    return sum(int((model(x[s : s + 1000]).argmax(1) == y[s : s + 1000]).sum()) for s in range(0, y.shape[0], 1000))


def fastest(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return min(times)


def measure(client: ClientState, algorithm, knowledge: dict, batch_size: int, lr: float,
            repeats: int) -> tuple[float, float, float]:
    """(bare epoch, our epoch, evaluation) seconds, each the fastest of ``repeats``; the two epochs
    alternate, so that a change of background load hits both."""
    bare, ours = [], []
    def bare_run() -> None:
        bare_epoch(client.model, client.train_x, client.train_y, batch_size, lr,
                   torch_generator(0, "bench", client.client_id))

    def our_run() -> None:
        algorithm.train(client, knowledge, 0, torch_generator(0, "bench", client.client_id))

    for _ in range(repeats):
        bare.append(fastest(bare_run, 1))
        ours.append(fastest(our_run, 1))
    evaluation = fastest(lambda: evaluate(client.model, client.test_x, client.test_y), repeats)
    return min(bare), min(ours), evaluation


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config, [f"algorithm={args.algorithm}", *args.set])
    info = prepare_partition(config.data, config.num_clients, config.seed)
    entry = get_algorithm(config.algorithm)
    context = AlgorithmContext(num_classes=info.num_classes, feature_dim=config.model.feature_dim, seed=config.seed,
                               train=config.train, options=parse_options(entry, config.algo),
                               num_clients=config.num_clients, model_group=config.model.group,
                               in_channels=info.in_channels, image_size=info.image_size)
    algorithm = entry.client(context)
    empty = {field.name: torch.empty((0, *field.trailing_shape), dtype=field.dtype)
             for field in entry.server.download_fields(context)}
    rows, per_arch = [], {}
    for client_id in args.clients if args.clients is not None else range(config.num_clients):
        split = load_client_split(info.path, client_id)
        model = initial_client_model(config.model.group, client_id, config.seed, num_classes=info.num_classes,
                                     feature_dim=config.model.feature_dim, in_channels=info.in_channels,
                                     image_size=info.image_size, init=config.model.init)
        client = ClientState(client_id, architecture_for_client(config.model.group, client_id), model,
                             torch.optim.SGD(model.parameters(), lr=config.train.lr), split.train_x, split.train_y,
                             split.test_x, split.test_y, torch.device("cpu"))
        samples = split.train_y.shape[0]
        bare_s, ours_s, evaluation = measure(client, algorithm, empty, config.train.batch_size, config.train.lr,
                                             args.repeats)
        rows.append([client_id, client.architecture, samples, f"{samples / bare_s:.0f}", f"{samples / ours_s:.0f}",
                     f"{(ours_s / bare_s - 1) * 100:+.1f} %", f"{evaluation / ours_s * 100:.1f} %"])
        per_arch.setdefault(client.architecture, []).append((bare_s, ours_s, evaluation))
        print(f"client {client_id}: {client.architecture}, {samples} samples, bare {bare_s:.3f}s, ours {ours_s:.3f}s",
              file=sys.stderr, flush=True)
    print(f"{config.data.dataset} {config.data.partition}, {config.model.group}, batch {config.train.batch_size}, "
          f"algorithm {config.algorithm}, 1 thread, fastest of {args.repeats}")
    print(markdown_table(["client", "architecture", "train samples", "bare samples/s", "ours samples/s",
                          "our overhead", "evaluation / training epoch"], rows))
    total_bare = sum(b for times in per_arch.values() for b, _, _ in times)
    total_ours = sum(o for times in per_arch.values() for _, o, _ in times)
    total_eval = sum(e for times in per_arch.values() for _, _, e in times)
    print(f"\nall clients: bare {total_bare:.2f}s, ours {total_ours:.2f}s, overhead "
          f"{(total_ours / total_bare - 1) * 100:+.1f} %; evaluating every client adds "
          f"{total_eval:.2f}s ({total_eval / total_ours * 100:.1f} % of the training)")
    overheads = [o / b - 1 for times in per_arch.values() for b, o, _ in times]
    print(f"per-client overhead: median {statistics.median(overheads) * 100:+.1f} %, "
          f"max {max(overheads) * 100:+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
