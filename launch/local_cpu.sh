#!/usr/bin/env bash
# Multi-process run on one machine over Gloo (CPU), e.g.
#   launch/local_cpu.sh 3 configs/smoke.yaml --out runs/smoke
# NPROC ranks: rank 0 is the server, ranks 1..NPROC-1 host the clients.
set -euo pipefail
nproc="${1:?usage: local_cpu.sh NPROC CONFIG [--out DIR] [key=value ...]}"
config="${2:?usage: local_cpu.sh NPROC CONFIG [--out DIR] [key=value ...]}"
shift 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM (Ctrl-C, kill); a rank finishes
# its round and checkpoints first (runtime.preempt_grace_s, 120 s), so give it that long.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-150}"
# One process checks the config and the run directory first (python -m htfl_dist.main --check):
# a mistake is our one line and exit status 2, not that line followed by torchrun's ChildFailedError
# traceback and summary (40-90 lines) and exit status 1.
python -m htfl_dist.main --check --world-size "$nproc" --config "$config" runtime.backend=gloo runtime.device=cpu "$@" \
  >/dev/null
exec torchrun --standalone --nproc_per_node="$nproc" -m htfl_dist.main --config "$config" runtime.backend=gloo runtime.device=cpu "$@"
