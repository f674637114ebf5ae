#!/usr/bin/env bash
# Multi-process run under MPI (mpi4py transport), e.g.
#   launch/mpi.sh 3 configs/smoke.yaml --out runs/smoke-mpi
# With `pip install mpich` (done by launch/setup_env.sh) mpirun needs no system MPI.
set -euo pipefail
nproc="${1:?usage: mpi.sh NPROC CONFIG [--out DIR] [key=value ...]}"
config="${2:?usage: mpi.sh NPROC CONFIG [--out DIR] [key=value ...]}"
shift 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec mpirun -n "$nproc" python -m htfl_dist.main --config "$config" "$@"
