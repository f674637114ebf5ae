#!/usr/bin/env bash
# The GPU suite in one command, on a GPU machine without network (bench/gpu_suite.py says what it
# measures; docs/running.md how to run it):
#   bash bench/gpu_suite.sh DIR OUT [--budget-s 480] [--device cpu --tiny] [--work SCRATCH]
# DIR: what bench/gpu_prepare.sh wrote. OUT: summary.md (rewritten after every step, so a run cut
# off keeps its figures), results.json and logs/. htfl_dist is imported from this source tree
# (PYTHONPATH); nothing is installed. PYTHON picks the interpreter (default python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
"$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")'
exec "$py" "$repo/bench/gpu_suite.py" "$@"
