#!/usr/bin/env bash
# One call of the device tool (a lent GPU machine, no network), as run on 2026-11-26 (benchmarks/RESULTS.md
# §4, §9.4): the environment, the carried wheels, tests/gpu and the GPU throughput benchmark
# (scripts/gpu_check.sh), then the checkpoint digests' cost on CPU/gloo ranks of that machine's cores.
# Every step logs under $OUT and runs under `timeout`, sized from one overall budget, so one hang
# cannot eat the rest; the last lines summarise for the call's output tail.
#   here:   bash scripts/gpu_wheels.sh .whl
#   device: bash scripts/gpu_device_run.sh       (carry: .whl; timeout_s 480; ~420 s on an H200: tests/gpu
#           took 117 s there on 2026-11-27, the throughput benchmark ~90 s)
# Local dry run: PY=.venv/bin/python SKIP_INSTALL=1 BUDGET=200 OUT=/tmp/o bash scripts/gpu_device_run.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?OUT unset}
PY=${PY:-python3}
BUDGET=${BUDGET:-420}                  # seconds from here to the last step's end
SITE=${SMP_GPU_SITE:-/tmp/smp-gpu-site}
CK=/tmp/smp-devrun-ck; rm -rf "$CK"; mkdir -p "$CK"
T0=$(date +%s)
export PYTHONUNBUFFERED=1
left() { echo $((BUDGET - ($(date +%s) - T0))); }
mark() { echo "[t=$(($(date +%s) - T0))s left=$(left)s] $*" >>"$OUT/env.txt"; }
run() { local t=$1; shift; [ "$t" -lt 5 ] && { mark "SKIP (no time): $*"; return 124; }
        timeout -k 5 "$t" "$@"; local c=$?; mark "exit $c (timeout $t): $*"; return $c; }

# ---- 4. environment --------------------------------------------------------------------------
{ mark "start"; nproc; uname -r; df -h /tmp | tail -1; free -g | head -2
  timeout 15 nvidia-smi; timeout 20 "$PY" -m pip show torch transformers accelerate typing_extensions packaging \
    numpy xxhash pytest pytest-timeout pydantic 2>&1 | grep -E '^(Name|Version|Location)|WARNING'
} >>"$OUT/env.txt" 2>&1

# ---- 1. carried wheels into a private site (typing_extensions only if the image's is < 4.16) ------
if [ -z "${SKIP_INSTALL:-}" ]; then
  W=(.whl/*.whl)
  "$PY" -c 'import importlib.metadata as m,sys; v=tuple(int(x) for x in m.version("typing_extensions").split(".")[:2]); sys.exit(v<(4,16))' \
    2>>"$OUT/install.log" || W+=(.whl/extra/*.whl)
  printf '%s\n' "${W[@]}" >>"$OUT/install.log"
  run 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "${W[@]}" >>"$OUT/install.log" 2>&1
  export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$PWD/adapter${PYTHONPATH:+:$PYTHONPATH}"
# compatibility probe (torch 2.11 vs the repo's 2.13), in the background: CPU only, ~5-10 s
(timeout 60 "$PY" scripts/gpu_device_probe.py >"$OUT/probe.txt" 2>&1) &
PROBE=$!

# ---- 2. tests/gpu, then the GPU throughput benchmark (run alone if the tests fail) -------------
BENCH="--rounds 2 --warmup 3 --steps 10 --timeout 100 --json $OUT/gpu_tput.json"
"$PY" -c 'import pytest_timeout' 2>/dev/null && export PYTEST_ADDOPTS="--timeout=120"
G=$(( $(left) - 105 )); [ "$G" -gt 210 ] && G=210
GPU_BENCH_ARGS="$BENCH" PYTHON="$PY" run "$G" bash scripts/gpu_check.sh .no-wheels >>"$OUT/gpu_check.log" 2>&1
unset PYTEST_ADDOPTS
wait "$PROBE"
if ! grep -q "RESULT benchmarks/gpu_throughput.py exit" "$OUT/gpu_check.log" && grep -q "RESULT tests/gpu exit" "$OUT/gpu_check.log"; then
  G=$(( $(left) - 100 )); [ "$G" -gt 150 ] && G=150
  run "$G" "$PY" benchmarks/gpu_throughput.py $BENCH >>"$OUT/gpu_bench2.log" 2>&1
fi
timeout 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$OUT/env.txt" 2>&1

# ---- 3. checkpoint digests on CPU/gloo ranks (GPU hidden: smp would pick NCCL/CUDA otherwise) ----
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
run 20 "$PY" benchmarks/checkpoint.py --hash-speed >>"$OUT/ckpt.log" 2>&1
MODES=(zero0 zero3 pp2 pp2:0)   # mode[:SMP_ADAPTER_DIGEST_THREADS]; pp2 last: pipelining is the likeliest torch-2.11 casualty
n=${#MODES[@]}
# one --repeats for every mode, from the time left: ~10 s fixed + <= 2 s a repeat per mode (2-core dev box:
# ~8 s + 1.5 s), odd, 5..21
R=$(( ($(left) - 3) / n )); R=$(( (R - 10) / 2 )); [ "$R" -gt 21 ] && R=21; [ "$R" -lt 5 ] && R=5; R=$((R | 1))
for i in "${!MODES[@]}"; do
  m=${MODES[$i]%%:*}; th=${MODES[$i]#*:}; [ "$th" = "${MODES[$i]}" ] && th=""; rest=$((n - i - 1))
  T=$(( $(left) - 3 - 20 * rest ))
  echo "== $m threads '${th:-auto}' --repeats $R (timeout ${T}s)" >>"$OUT/ckpt.log"
  SMP_ADAPTER_DIGEST_THREADS=$th run "$T" "$PY" benchmarks/checkpoint.py --digests --modes "$m" --repeats "$R" \
    --json "$CK/$m${th:+_t$th}.json" >>"$OUT/ckpt.log" 2>&1
  "$PY" -c 'import glob,json,os,sys; json.dump({os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(sys.argv[2] + "/*.json"))}, open(sys.argv[1], "w"), indent=1)' "$OUT/ckpt.json" "$CK" 2>>"$OUT/ckpt.log"
done
mark "end"
# summary for the call's output_tail (the files under $OUT hold everything)
grep -h '^\[t=' "$OUT/env.txt"; grep -h -E 'RESULT|passed|failed|error' "$OUT/gpu_check.log" | tail -8
grep -h -E '^# |round |adapter/native' "$OUT/gpu_check.log" "$OUT/gpu_bench2.log" 2>/dev/null
grep -h -E '^== |^(zero0|zero3|pp2) |^hash|^xxh3|Error' "$OUT/ckpt.log"; grep -h -E 'FAIL|: False|import failures' "$OUT/probe.txt"
