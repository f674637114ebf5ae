#!/usr/bin/env bash
# One node, one rank per GPU (NCCL when every rank owns a GPU), e.g.
#   launch/gpu_node.sh configs/fmnist_htcnn8_fedproto_dirichlet.yaml --out runs/fp
# Each rank runs on GPU LOCAL_RANK mod G, so with G GPUs rank 0 (the server) has GPU 0 to itself and
# the clients spread over ranks 1..G-1, one GPU each (one GPU: a single process hosts everything).
# NPROC=N ranks instead of G: N > G oversubscribes (rank G shares GPU 0 with the server, and so on)
# and runtime.backend=auto picks Gloo; N < G leaves GPUs N..G-1 idle.
set -euo pipefail
config="${1:?usage: gpu_node.sh CONFIG [--out DIR] [key=value ...]}"
shift
gpus="${NPROC:-$(nvidia-smi -L | wc -l)}"
# torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM (Ctrl-C, kill); a rank finishes
# its round and checkpoints first (runtime.preempt_grace_s, 120 s), so give it that long.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-150}"
# One process checks the config and the run directory first (python -m htfl_dist.main --check):
# a mistake is our one line and exit status 2, not that line followed by torchrun's ChildFailedError
# traceback and summary (40-90 lines) and exit status 1.
python -m htfl_dist.main --check --world-size "$gpus" --config "$config" "$@" >/dev/null
exec torchrun --standalone --nproc_per_node="$gpus" -m htfl_dist.main --config "$config" "$@"
