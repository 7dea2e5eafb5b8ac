#!/usr/bin/env bash
# Prepare, on a machine that reaches a package registry, the wheels scripts/gpu_check.sh installs on a
# GPU machine that reaches none. A typical GPU image holds torch and transformers but not deepspeed or
# megatron-core; these are them and their pure-Python needs such an image lacks.
#   bash scripts/gpu_wheels.sh [DIR]        (default .whl; GPU_PYTHON_VERSION=3.12 is the image's Python)
# DeepSpeed publishes only a source archive: it is built here into a pure-Python wheel (its CUDA ops
# are compiled just in time on the GPU machine), with this checkout's .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${GPU_PYTHON_VERSION:-3.12}
PY=.venv/bin/python
[ -x "$PY" ] || bash scripts/setup.sh
mkdir -p "$DIR"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" \
  "megatron-core==${MEGATRON_CORE_VERSION:-0.16.1}" hjson pydantic pydantic-core annotated-types typing-inspection
# pydantic-core needs typing-extensions >= 4.16: carried aside, installed only where the image's is older
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR/extra" "typing_extensions>=4.16"
ls -1 "$DIR" "$DIR/extra"
echo "carry $DIR to the GPU machine and run: bash scripts/gpu_check.sh $DIR"
