"""Benchmark: does the counted cost of an architecture predict its training time per sample?

Placement weighs each client's training samples by its architecture's forward FLOPs per sample
(htfl_dist/models/cost.py), counted on the meta device so every rank gets the same number. This
times real SGD steps (batch ``--batch``, one thread, random data at the config's shape) for every
member of a model group and prints, per member: forward MFLOPs per sample, parameters,
milliseconds per step, and both normalised to the cheapest member. If the two normalised columns
agree, FLOP weighting places the work as it will run.

    python bench/arch_cost.py                                   # HtCNN8 on FMNIST shapes
    python bench/arch_cost.py --group HtFE8 --image-size 32 --channels 3 --classes 100
    python bench/arch_cost.py --group HtFE8 --image-size 32 --channels 3 --classes 100 --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from htfl_dist.metrics.report import markdown_table
from htfl_dist.models import build_model, resolve_group
from htfl_dist.models.cost import forward_flops_per_sample


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", default="HtCNN8")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--feature-dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="the fastest repeat counts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then also the peak memory of a step)")
    return parser.parse_args()


def step_ms(member: str, args: argparse.Namespace) -> tuple[float, float]:
    """Milliseconds per SGD step (forward, backward, step), the fastest of ``--repeats``, and on a
    GPU the peak memory (MiB) the allocator held for it (model, optimizer state, activations)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(member, num_classes=args.classes, feature_dim=args.feature_dim,
                        in_channels=args.channels, image_size=args.image_size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, args.channels, args.image_size, args.image_size, device=device)
    y = torch.randint(0, args.classes, (args.batch,), device=device)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = float("inf")
    for repeat in range(args.repeats + 1):  # the first repeat warms up
        synchronize(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        synchronize(device)
        if repeat:
            best = min(best, (time.perf_counter() - started) * 1000 / args.steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return best, peak


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    rows = []
    for member in dict.fromkeys(resolve_group(args.group)):
        flops = forward_flops_per_sample(member, num_classes=args.classes, feature_dim=args.feature_dim,
                                         in_channels=args.channels, image_size=args.image_size)
        params = sum(p.numel() for p in build_model(member, num_classes=args.classes, feature_dim=args.feature_dim,
                                                    in_channels=args.channels,
                                                    image_size=args.image_size).parameters())
        rows.append((member, flops, params, *step_ms(member, args)))
    cheapest_flops = min(r[1] for r in rows)
    cheapest_ms = min(r[3] for r in rows)
    table = [[m, f"{f / 1e6:.2f}", f"{p / 1e6:.2f} M", f"{ms:.2f}", f"{f / cheapest_flops:.2f}",
              f"{ms / cheapest_ms:.2f}", "n/a" if peak != peak else f"{peak:.0f}"] for m, f, p, ms, peak in rows]
    print(f"device: {args.device}, batch {args.batch}")
    print(markdown_table(["member", "forward MFLOPs/sample", "parameters", "ms/step",
                          "FLOPs (rel.)", "time (rel.)", "peak MiB"], table))
    ratio = [(ms / cheapest_ms) / (f / cheapest_flops) for _, f, _, ms, _ in rows]
    print(f"\ntime/FLOPs ratio across members: min {min(ratio):.2f}, max {max(ratio):.2f}, "
          f"mean {statistics.fmean(ratio):.2f} (1.00 everywhere = FLOPs predict time exactly)")


if __name__ == "__main__":
    main()
