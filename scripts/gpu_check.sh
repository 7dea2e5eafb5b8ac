#!/usr/bin/env bash
# The GPU checks in one command, on a machine with an NVIDIA GPU and no network:
#   bash scripts/gpu_check.sh [WHEEL_DIR]     (default .whl, made beforehand by scripts/gpu_wheels.sh)
# Installs the carried wheels into a private directory (the image's packages stay as they are), runs
# tests/gpu, then benchmarks/gpu_throughput.py (arguments from GPU_BENCH_ARGS), and prints the
# figures RESULTS.md records. Exit status: the tests' (or 2 when there is no CUDA device), then the
# benchmark's if the tests passed.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
PY=${PYTHON:-python3}
SITE=${SMP_GPU_SITE:-/tmp/smp-gpu-site}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/adapter:$PYTHONPATH" PYTHONUNBUFFERED=1
if ! "$PY" -c "import torch, deepspeed, megatron.core, transformers" 2>/dev/null; then
  "$PY" -c "import torch, deepspeed, megatron.core, transformers"
  echo "gpu_check: a package is missing (above): run scripts/gpu_wheels.sh where a registry is reachable and carry its directory" >&2
  exit 1
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device: nothing to check here (CI's CPU suite is scripts/test.sh)" >&2
  exit 2
fi
"$PY" - <<'PY'
import deepspeed, megatron.core, torch, transformers
p = torch.cuda.get_device_properties(0)
print(f"RESULT device: {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, deepspeed {deepspeed.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformers {transformers.__version__}")
PY
"$PY" -m pytest tests/gpu -q -p no:cacheprovider -rA --durations=10
code=$?
echo "RESULT tests/gpu exit $code"
[ "$code" -eq 0 ] || exit "$code"
# shellcheck disable=SC2086
"$PY" benchmarks/gpu_throughput.py ${GPU_BENCH_ARGS:-}
code=$?
echo "RESULT benchmarks/gpu_throughput.py exit $code"
exit "$code"
