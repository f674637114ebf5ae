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

``--whole-round R`` then runs the same config as a user would (``python -m htfl_dist.main``, one
process, one thread, R rounds, every round evaluated) and compares its median round (rounds 2..R;
round 1 carries start-up) with the sum of the bare epochs + the evaluations + its own server step:
the issue's "whole round within 5 % of the bare loop's time for the same work".

    python bench/client_throughput.py
    python bench/client_throughput.py --algorithm fedproto --clients 0 1 2 3
    python bench/client_throughput.py --whole-round 4 --set data.subsample=0.2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_clients import build_client, client_algorithm, run_program

from htfl_dist.algorithms import ClientState
from htfl_dist.config import load_config
from htfl_dist.data import prepare_partition
from htfl_dist.metrics.report import markdown_table
from htfl_dist.seeding import torch_generator

REPO = Path(__file__).resolve().parents[1]
BARE_LOOP_ORDER = ["train.batch_order=shuffled", "train.last_batch=keep"]
"""What the bare loop does (a fresh permutation, every sample): our path is set to the same work."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="default: configs/fmnist_htcnn8_<algorithm>_dirichlet.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value")
    parser.add_argument("--algorithm", default="local")
    parser.add_argument("--clients", nargs="*", type=int, help="client ids (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole-round", type=int, default=0, metavar="R",
                        help="also run R rounds of the real program and compare a round with the bare work")
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


def whole_round(args: argparse.Namespace, bare_training: float, evaluation: float) -> None:
    """One process, one thread, ``args.whole_round`` rounds of the real program on the same config;
    its median round against the bare loop's epochs + evaluating every client + the server step."""
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_program(args.config, Path(scratch) / "run", [f"algorithm={args.algorithm}",
                           f"rounds={args.whole_round}", "eval_every=1", *BARE_LOOP_ORDER, *args.set])
    timed = rows[1:] or rows
    seconds = statistics.median(row["seconds"] for row in timed)
    server = statistics.median(row["server_s"] for row in timed)
    budget = bare_training + evaluation + server
    per_round = ", ".join(f"{row['seconds']:.2f}" for row in timed)
    print(f"\nwhole round ({len(timed)} rounds timed, median): {seconds:.2f}s; bare epochs {bare_training:.2f}s "
          f"+ evaluation {evaluation:.2f}s + server {server:.2f}s = {budget:.2f}s; ours "
          f"{(seconds / budget - 1) * 100:+.1f} % (per round: {per_round})")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    args.config = args.config or str(REPO / "configs" / f"fmnist_htcnn8_{args.algorithm}_dirichlet.yaml")
    config = load_config(args.config, [f"algorithm={args.algorithm}", *BARE_LOOP_ORDER, *args.set])
    info = prepare_partition(config.data, config.num_clients, config.seed, batch_size=config.train.batch_size)
    algorithm, empty = client_algorithm(config, info, torch.device("cpu"))
    rows, per_arch = [], {}
    for client_id in args.clients if args.clients is not None else range(config.num_clients):
        client = build_client(config, info, client_id, torch.device("cpu"), algorithm)
        samples = client.train_y.shape[0]
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
    if args.whole_round:
        if args.clients is not None:
            sys.exit("bench: --whole-round times every client; leave --clients out")
        whole_round(args, total_bare, total_eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
