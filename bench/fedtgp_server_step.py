"""Benchmark: cost of FedTGP's server update (S epochs of margin contrastive SGD) in isolation.

Prints seconds per server update and milliseconds per SGD step for a synthetic round of
uploads shaped like the paper's setups (20 clients, K = 512). Compare the seconds with a
round's client time from metrics.jsonl (client_s) to get the server's share of a round.

    python bench/fedtgp_server_step.py                         # FMNIST-like: C = 10
    python bench/fedtgp_server_step.py --classes 100 --held 10 # CIFAR-100 pathological-like
    python bench/fedtgp_server_step.py --device cuda
    python bench/fedtgp_server_step.py --count-ops             # ATen ops dispatched per step

On a GPU the ~1000 steps of an update are bound by per-op dispatch and kernel launches, not by
arithmetic, so ``--count-ops`` reports the device-independent quantity to keep small.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from htfl_dist.algorithms import AlgorithmContext, get_algorithm, parse_options
from htfl_dist.config import TrainConfig
from htfl_dist.seeding import seed_global_torch, torch_generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--held", type=int, default=5, help="classes each client uploads")
    parser.add_argument("--feature-dim", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=100, help="S")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--count-ops", action="store_true", help="count ATen ops per step (one extra update)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    entry = get_algorithm("fedtgp")
    options = parse_options(entry, {"server_epochs": args.epochs})
    context = AlgorithmContext(num_classes=args.classes, feature_dim=args.feature_dim, seed=0,
                               train=TrainConfig(), options=options, device=device)
    seed_global_torch(0, "server-init")
    server = entry.server(context)
    generator = torch.Generator().manual_seed(1)
    uploads = {}
    for client in range(args.clients):
        held = torch.randperm(args.classes, generator=generator)[: args.held].sort().values
        protos = 3 * torch.randn(len(held), args.feature_dim, generator=generator)
        uploads[client] = {"class_ids": held, "protos": protos}
    pairs = args.clients * args.held
    steps = args.epochs * -(-pairs // TrainConfig().batch_size)
    for round_index in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        diagnostics = server.update(uploads, round_index, torch_generator(0, "server", round_index))
        server.download()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        print(f"C={args.classes} pairs={pairs} S={args.epochs} device={device}: round {round_index}: "
              f"{seconds:.3f} s per update, {seconds / steps * 1e3:.3f} ms per step "
              f"(server_loss {diagnostics['server_loss']:.3f}, margin {diagnostics['margin']:.2f})")
    if args.count_ops:
        with OpCounter() as counter:
            server.update(uploads, args.rounds, torch_generator(0, "server", args.rounds))
        print(f"{counter.count / steps:.1f} ATen ops dispatched per step (whole update / steps)")


class OpCounter(TorchDispatchMode):
    """Counts every ATen op that reaches the dispatcher (forward, backward and optimizer).

    TorchDispatchMode lives in a private torch module; it is the mechanism torch's own
    FlopCounterMode is built on, and this is a benchmark, not library code."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    main()
