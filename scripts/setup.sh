#!/usr/bin/env bash
# Creates a Python environment with the CPU build of torch, smp-adapter (editable) and its test extras.
# Idempotent. torch is installed first and pinned: an unpinned resolve would pull several GB of CUDA wheels.
#
#   bash scripts/setup.sh                          .venv: the newest versions pyproject.toml allows
#   bash scripts/setup.sh constraints/lowest.txt   a matrix point: the versions the constraints file pins,
#                                                  in $SMP_MATRIX_ENVS/<file name>-<hash> (printed last)
#
# A matrix environment lives outside the clone (default ~/.cache/smp-adapter/envs) so that a second run,
# in this clone or a fresh one, only re-points the editable install at the clone (seconds). It is rebuilt
# when pyproject.toml's dependencies or the constraints file change (the hash is over both). Its first
# build resolves pyproject.toml's ranges with the constraints: a pin outside a range fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEY_PACKAGES="import torch, deepspeed, megatron.core, transformers, accelerate, smp_adapter"

if [ "$#" -eq 0 ]; then
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  if ! .venv/bin/python -c "$KEY_PACKAGES" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.smp-installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    .venv/bin/python -m pip install -q -e ".[test,hf-data]"
    touch .venv/.smp-installed
  fi
  exit 0
fi

constraints=$1
if [ ! -f "$constraints" ]; then
  echo "setup.sh: no constraints file $constraints (give a file such as constraints/lowest.txt)" >&2
  exit 2
fi
name=$(basename "$constraints" .txt)
hash=$(cat pyproject.toml "$constraints" | sha256sum | cut -c1-12)
root=${SMP_MATRIX_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/smp-adapter/envs}
env="$root/$name-$hash"
if [ ! -f "$env/.smp-installed" ]; then
  rm -rf "$env"
  mkdir -p "$root"
  "$PY" -m venv "$env"
  "$env/bin/python" -m pip install -q --upgrade pip
  # torch first, at the version the constraints pin (the CPU build; see above)
  torch_pin=$(grep -E '^torch==' "$constraints" | head -1)
  "$env/bin/python" -m pip install -q "${torch_pin:-torch==${TORCH_VERSION:-2.13.0}}"
  # the extras a point installs: its "# extras:" line (default: test), e.g. no hf-data where its tqdm pin is too low
  extras=$(sed -n 's/^# extras: *//p' "$constraints" | head -1)
  "$env/bin/python" -m pip install -q -c "$constraints" -e ".[${extras:-test}]"
  touch "$env/.smp-installed"
else
  # the cached environment's dependencies are current: point its editable install at this clone
  "$env/bin/python" -m pip install -q --no-deps -e . >/dev/null
fi
if ! "$env/bin/python" -c "$KEY_PACKAGES" >/dev/null 2>&1; then
  echo "setup.sh: $env cannot import its packages ($KEY_PACKAGES); remove it and run again" >&2
  exit 1
fi
echo "$env"
