#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and smp-adapter (editable) + test extras. Idempotent.
# torch is installed first and pinned: an unpinned resolve would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, deepspeed, megatron.core, transformers, smp_adapter" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.smp-installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.smp-installed
fi
