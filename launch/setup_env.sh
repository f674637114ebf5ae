#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install htfl_dist with its test and MPI extras.
# Idempotent and quiet when everything is present, so CI and users can run it every time.
#   HTFL_VENV      where the venv lives (default: ~/.cache/htfl_dist/venv, outside the clone)
#   HTFL_TORCH     pip spec for torch/torchvision (default: the pinned pair this project tests)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HTFL_VENV:-$HOME/.cache/htfl_dist/venv}"
torch_spec="${HTFL_TORCH:-torch==2.14.1 torchvision==0.29.1}"

# Fashion-MNIST, the embedded default dataset, comes from the OS package.
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "setup: installing dataset-fashion-mnist (Debian package)"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

# SLURM and munge for tests/e2e/test_slurm.py (a throw-away two-node cluster in network namespaces).
# Only as root with apt-get; elsewhere that test skips.
have() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null; }
if [ "$(id -u)" -eq 0 ] && have apt-get && ! { have slurmctld && have munged && have ip; }; then
  echo "setup: installing slurm-wlm, munge and iproute2 (Debian packages, for tests/e2e/test_slurm.py)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, torchvision" 2>/dev/null; then
  echo "setup: installing $torch_spec"
  "$py" -m pip install -q $torch_spec
fi
# (checked from / so that a checkout in the current directory does not shadow the install)
installed_at=$(cd / && "$py" -c 'import htfl_dist, os; print(os.path.dirname(os.path.dirname(htfl_dist.__file__)))' 2>/dev/null || true)
# (types-PyYAML installs no importable module, and importing mlflow or wandb takes seconds: checked by their metadata)
if ! (cd / && "$py" -c "import htfl_dist, mpi4py, h5py, yaml, pytest, xdist, PIL, scipy, matplotlib, tensorboard, opacus, cryptography, ruff, mypy, importlib.metadata as m; [m.version(d) for d in ('types-PyYAML', 'mlflow-skinny', 'wandb')]" 2>/dev/null) \
   || [ "$installed_at" != "$repo" ] || [ ! -x "$venv/bin/mpirun" ]; then
  echo "setup: installing htfl_dist (editable) with test, MPI and privacy extras"
  "$py" -m pip install -q -e "$repo[test,mpi,privacy]"
fi
# FedKTL's built-in generator: the DCGAN weights in the gan-face-generate wheel (MIT, 14 MB). Its
# declared dependencies (wandb, requests, ...) are not needed to read the weights, hence --no-deps.
if ! (cd / && "$py" -c "import importlib.metadata as m; assert m.version('gan-face-generate') == '1.1.1'" 2>/dev/null); then
  echo "setup: installing gan-face-generate 1.1.1 (FedKTL's pre-trained generator, no dependencies)"
  "$py" -m pip install -q --no-deps gan-face-generate==1.1.1
fi
echo "setup: ready ($venv)"
