#!/usr/bin/env bash
# Assemble, on a machine with network, what bench/gpu_suite.sh needs on a GPU machine that has none:
#   bench/gpu_prepare.sh DIR [--htfllib SOURCE] [--commit SHA] [--no-reference] [--no-wheels]
# DIR (kept out of git: under runs/ or outside the checkout) then holds, in about 35 MiB:
#   fmnist/    Fashion-MNIST's four IDX files (from the OS package, or $HTFL_FMNIST_DIR)
#   htfllib/   HtFLlib's system/ at commit SHA (default 728e52a, the last commit with the
#              HCNNs8 family, FedTGP Table 10's models), without the two folders of FedKTL's image generators
#              (StyleGAN and Stable Diffusion: binaries, unused here), plus COMMIT naming it
#   wheels/    Opacus, cryptography and its cffi for the suite's DP-SGD step (the GPU image lacks them;
#              the suite unpacks them into its work folder, nothing is installed)
#   pfl-wheels/ pfl-research 0.6.0 and the packages of its that the GPU image lacks (step 6)
# SOURCE: a git URL (default https://github.com/TsingZ0/HtFLlib.git) or a local clone or bare
# mirror of it. --no-reference leaves htfllib/ out (the suite then runs our side alone);
# --no-wheels leaves wheels/ out (a machine whose Python already has Opacus and cryptography).
set -euo pipefail
usage="usage: gpu_prepare.sh DIR [--htfllib SOURCE] [--commit SHA] [--no-reference] [--no-wheels]"
dir="${1:?$usage}"; shift
source="https://github.com/TsingZ0/HtFLlib.git"
commit="728e52a"
reference=1
wheels=1
while [ $# -gt 0 ]; do
  case "$1" in
    --htfllib) source="${2:?$usage}"; shift 2 ;;
    --commit) commit="${2:?$usage}"; shift 2 ;;
    --no-reference) reference=0; shift ;;
    --no-wheels) wheels=0; shift ;;
    *) echo "gpu_prepare: unknown argument $1; $usage" >&2; exit 2 ;;
  esac
done
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
  echo "gpu_prepare: $dir exists and is not empty; name a new directory" >&2; exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${HTFL_VENV:-$HOME/.cache/htfl_dist/venv}/bin/python"
[ -x "$py" ] || py=python3
mkdir -p "$dir"
partial="$dir/.partial"
rm -rf "$partial"; mkdir -p "$partial"

fmnist="${HTFL_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"
mkdir -p "$partial/fmnist"
for name in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -f "$fmnist/$name" ] || { echo "gpu_prepare: $fmnist/$name missing (bash launch/setup_env.sh installs it)" >&2; exit 2; }
  cp "$fmnist/$name" "$partial/fmnist/"
done

if [ "$reference" = 1 ]; then
  clone="$partial/.htfllib-git"
  if [ -d "$source/objects" ]; then           # a bare repository or mirror
    git_dir="$source"
  elif [ -d "$source/.git" ]; then
    git_dir="$source/.git"
  else
    git clone -q --bare --filter=blob:none "$source" "$clone"
    git_dir="$clone"
  fi
  sha="$(git --git-dir="$git_dir" rev-parse --verify "$commit^{commit}")"
  paths="$(git --git-dir="$git_dir" ls-tree -r --name-only "$sha" system \
            | grep -v -e '^system/stylegan/' -e '^system/stable-diffusion/')"
  # (blob by blob: a partial clone or mirror may lack the generators' binaries, which are skipped)
  for path in $paths; do
    mkdir -p "$partial/htfllib/$(dirname "$path")"
    git --git-dir="$git_dir" cat-file blob "$sha:$path" > "$partial/htfllib/$path"
  done
  echo "$sha" > "$partial/htfllib/COMMIT"
  rm -rf "$clone"
fi

# The DP-SGD step's two packages, as the wheels the GPU machine's Python 3.12 takes.
[ "$wheels" = 0 ] || "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$partial/wheels" "opacus==1.6.0" "cryptography==50.0.2" "cffi==2.0.0" "pycparser==2.23"

# pfl-research 0.6.0 and those of its packages the GPU image lacks (it has numpy, scipy, absl-py,
# attrs, mpmath, wrapt, packaging, wheel), for the suite's step 6: pfl beside ours on that GPU. They
# are unpacked into a folder on pfl's PYTHONPATH alone, never htfl_dist's (~0.8 MiB).
[ "$wheels" = 0 ] || "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$partial/pfl-wheels" "pfl==0.6.0" "dp-accounting==0.5.1" "dm-tree==0.1.10" "multiprocess==0.70.19" \
  "dill==0.4.1" "prv-accountant==0.2.0"

for part in "$partial"/*; do mv "$part" "$dir/"; done
rmdir "$partial"
echo "gpu_prepare: $dir ready ($(du -sh "$dir" | cut -f1)): $(ls "$dir" | tr '\n' ' ')"
echo "gpu_prepare: on the GPU machine run  bash bench/gpu_suite.sh $dir OUT"
