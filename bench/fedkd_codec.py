"""Benchmark: FedKD's SVD codec on the shared model's parameters, per client upload.

Prints, per parameter of the mentee (``htcnn1`` by default: client 0's member on HtCNN8, as in the
Table 10 configs), its shape, the kept rank, and the seconds of ``svd_compress`` against a plain
float64 ``torch.linalg.svd`` of the same matrix as it lies (wide matrices are decomposed through
their transpose by the codec). One upload's compression is what every client pays per round,
and the server once more for the download.

    python bench/fedkd_codec.py                          # htcnn1, T = 0.95, htfllib rule, 1 thread
    python bench/fedkd_codec.py --arch htcnn8 --rule fixed --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch

from htfl_dist.algorithms.compression import layout, svd_compress
from htfl_dist.models import build_model
from htfl_dist.seeding import seed_global_torch


def _seconds(call, repeats: int) -> float:
    call()  # warm-up: LAPACK workspaces, thread pool
    began = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - began) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="htcnn1")
    parser.add_argument("--energy", type=float, default=0.95)
    parser.add_argument("--rule", choices=("fixed", "htfllib"), default="htfllib")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seed_global_torch(0, "bench-fedkd-codec")
    model = build_model(args.arch, num_classes=10, feature_dim=512, in_channels=1, image_size=28)  # FMNIST
    codec_total = plain_total = 0.0
    print(f"{args.arch}, T = {args.energy}, rule {args.rule}, {args.threads} thread(s)")
    print(f"{'shape':>20} {'rank':>5} {'codec s':>8} {'plain svd s':>11}")
    for parameter in model.parameters():
        tensor = parameter.detach()
        shape = tuple(tensor.shape)
        codec = _seconds(lambda t=tensor: svd_compress(t, args.energy, args.rule), args.repeats)
        rank = svd_compress(tensor, args.energy, args.rule)[3]
        plain = 0.0
        if layout(shape, args.rule) == "matrix":
            matrix = tensor.reshape(shape[0], -1).double()
            plain = _seconds(lambda m=matrix: torch.linalg.svd(m, full_matrices=False), args.repeats)
        codec_total += codec
        plain_total += plain
        print(f"{list(shape)!s:>20} {rank:>5} {codec:>8.3f} {plain:>11.3f}")
    print(f"one upload: codec {codec_total:.3f} s; matrices SVD'd as they lie {plain_total:.3f} s")


if __name__ == "__main__":
    main()
