#!/usr/bin/env bash
# A virtual environment of its own for Apple's pfl-research (bench/pfl_side_by_side.py runs it
# beside htfl_dist). pfl is never a dependency of htfl_dist: it lives only in this venv.
#   HTFL_PFL_VENV   where the venv lives (default: ~/.cache/htfl_dist/pfl-venv, beside the engine's venv
#                   of launch/setup_env.sh; bench/pfl_side_by_side.py reads the same variable)
#   HTFL_PFL_TORCH  pip spec for torch (default: launch/setup_env.sh's pin, so both sides run the same kernels)
# pfl 0.6.0's PyTorch support is its `pytorch` extra (torch>=2.0.1,<3, from its wheel's metadata).
# Idempotent: quiet when pfl and torch already import.
set -euo pipefail
venv="${HTFL_PFL_VENV:-$HOME/.cache/htfl_dist/pfl-venv}"
torch_spec="${HTFL_PFL_TORCH:-torch==2.14.1}"
pfl_spec="pfl[pytorch]==0.6.0"
if [ ! -x "$venv/bin/python" ]; then
  echo "pfl_setup: creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! (cd / && "$py" -c "import importlib.metadata as m, torch, pfl; assert m.version('pfl') == '0.6.0'" 2>/dev/null); then
  echo "pfl_setup: installing $torch_spec and $pfl_spec"
  "$py" -m pip install -q $torch_spec "$pfl_spec"
fi
(cd / && "$py" -c "import importlib.metadata as m, torch; import pfl.model.pytorch; import sys; print(f'pfl_setup: ready ({sys.argv[1]}): pfl', m.version('pfl'), 'torch', torch.__version__)" "$venv")
