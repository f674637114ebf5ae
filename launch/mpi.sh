#!/usr/bin/env bash
# Multi-process run under MPI (mpi4py transport), e.g.
#   launch/mpi.sh 3 configs/smoke.yaml --out runs/smoke-mpi
# With `pip install mpich` (done by launch/setup_env.sh) mpirun needs no system MPI.
set -euo pipefail
nproc="${1:?usage: mpi.sh NPROC CONFIG [--out DIR] [key=value ...]}"
config="${2:?usage: mpi.sh NPROC CONFIG [--out DIR] [key=value ...]}"
shift 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# One process checks the config and the run directory first (python -m htfl_dist.main --check):
# a mistake is our one line and exit status 2, said before mpirun starts NPROC ranks that would each
# find it.
python -m htfl_dist.main --check --world-size "$nproc" --config "$config" "$@" >/dev/null
exec mpirun -n "$nproc" python -m htfl_dist.main --config "$config" "$@"
