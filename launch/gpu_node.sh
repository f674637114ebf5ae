#!/usr/bin/env bash
# One node, one rank per GPU (NCCL when every rank owns a GPU), e.g.
#   launch/gpu_node.sh configs/fmnist_htcnn8_fedproto_dirichlet.yaml --out runs/fp
# Rank 0 is the server; with G GPUs the clients spread over ranks 1..G-1 (rank 0 shares GPU 0).
set -euo pipefail
config="${1:?usage: gpu_node.sh CONFIG [--out DIR] [key=value ...]}"
shift
gpus="${NPROC:-$(nvidia-smi -L | wc -l)}"
exec torchrun --standalone --nproc_per_node="$gpus" -m htfl_dist.main --config "$config" "$@"
