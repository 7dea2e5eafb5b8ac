#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite on CPU (this is .ci/run).
#
# With no arguments:
#   1. the default stack (.venv: the newest versions pyproject.toml allows), the whole suite:
#      a. tests/unit and tests/gpu, one process: the hostile-input cases hold 1-2 s budgets of CPU time,
#         which another test's ranks on the same two cores could stretch in wall-clock time;
#      b. tests/distributed on two pytest workers (pytest-xdist, a test file per worker at a time, so a
#         module's cached sources are built once): its ranks spend much of their time waiting on each
#         other (gloo, pipeline stages, launcher start-up), and one worker left ~40 % of the two cores
#         idle. SMP_TEST_WORKERS=1 runs it in one process.
#   2. the support matrix (--matrix below); SMP_TEST_MATRIX=0 leaves it out. Its environments and unit
#      tiers run in the background beside 1a and 1b (see there), its distributed tests after 1b.
# --matrix: only the support matrix: for each constraints/*.txt (the other points of docs/supported-versions.md's
#   "Supported versions" table), an environment made by `scripts/setup.sh FILE` (cached outside the
#   clone) runs the unit tier and the distributed tests of the code that depends on that point's
#   versions ($MATRIX_TESTS: matrix_tests below). constraints/newest-torch.txt runs only with
#   SMP_TEST_NEWEST_TORCH=1 (its environment alone takes minutes to build; docs/supported-versions.md says how long).
# With other arguments, one pytest run over them in .venv (e.g. a single file while developing).
# Every part prints the versions it ran with.
set -uo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
PYTEST_ARGS=(-m pytest -q -p no:cacheprovider --durations=15)
# The matrix's distributed tests, per point. Both torch ends run torch's version-dependent surfaces:
# pipelining (torch.export tracing and its failure path, a stage's buffers set up again for an evaluation
# schedule, integer values crossing stages, several stages per rank, the split-backward schedules or
# their refusal below torch 2.13), a pipeline checkpoint loaded into a delayed-init model, DeepSpeed
# ZeRO-3's hooks over Hugging Face layers; and the container's install step keeping that torch. The
# CUDA-on-CPU mode is in the unit tier. The lowest point
# also runs the code that reads transformers' models and Megatron-core's layers at their floors (the
# TP mapping of each Hugging Face family, TP x DP reload through from_pretrained, ZeRO-3 and delayed
# init over each family's layers in the AWS-template style). The rest runs in the default stack only.
# transformers' Trainer (its SageMaker-MP path) runs on the transformers-4.57 point, transformers' last 4.x
# minor: the lowest point's transformers 4.38 cannot start a Trainer with accelerate >= 1.0 at all
# ("Accelerator(dispatch_batches=...)", without smp too); that point runs only the Trainer's tests and the
# unit files that read transformers (TRANSFORMERS_UNIT). The rest runs in the default stack only.
D=tests/distributed
TORCH_SURFACES=($D/test_pipeline.py::test_seed_manual_partition_simple_schedule
                $D/test_pipeline.py::test_boolean_values_crossing_stages
                $D/test_pipeline.py::test_gpt2_pp2_dp2_balanced_tied_embeddings
                "$D/test_pipeline.py::test_unsplittable_models_fail_on_every_rank[untraceable-UnsupportedFeatureError-profiling pass.*of Untraceable.*pipeline_parallel_degree: 1]"
                "$D/test_pipeline.py::test_unsplittable_models_fail_on_every_rank[compiling-None-]"
                "$D/test_pipeline.py::test_partial_checkpoint_resume_is_exact[gpt2-2-extra1-cli1]"
                "$D/test_pipeline_schedules.py::test_six_layers_sgd_pp2[interleaved_1f1b]"
                $D/test_pipeline_schedules.py::test_split_backward_schedules_or_their_refusal
                $D/test_aws_style_gpt.py::test_gpt2_sharded_data_parallel_hf_layers
                $D/test_sagemaker_toolkit.py::test_image_install_step_keeps_the_base_torch)
LIBRARY_FLOORS=($D/test_tensor_parallel.py::test_gpt2_and_llama_tp2 $D/test_tensor_parallel.py::test_other_hf_families_tp2
                $D/test_tp_runtime.py::test_gpt2_tp2_dp2_matches_and_reloads_with_from_pretrained
                $D/test_aws_style_gpt.py::test_falcon_sharded_data_parallel
                $D/test_aws_style_gpt.py::test_flan_t5_sharded_data_parallel_checkpointing
                $D/test_aws_style_gpt.py::test_gpt2_distributed_transformer_tp2_sdp2_checkpointing
                $D/test_aws_style_gpt.py::test_gptj_tp2_sdp2_delayed_init
                $D/test_aws_style_gpt.py::test_gpt_neox_sdp_delayed_init_bf16_sublayer_checkpointing)
TRAINER=($D/test_hf_trainer_glue.py)
TRANSFORMERS_UNIT=(tests/unit/test_cuda_on_cpu_loading.py tests/unit/test_transformers_smp_path.py
                   tests/unit/test_tp_marking.py tests/unit/test_deferred_init.py tests/unit/test_check_environment.py)
matrix_tests() {  # the distributed tests of matrix point $1 (a constraints file's name), into MATRIX_TESTS
  case "$1" in
    lowest) MATRIX_TESTS=("${TORCH_SURFACES[@]}" "${LIBRARY_FLOORS[@]}") ;;
    transformers-4.57) MATRIX_TESTS=("${TRAINER[@]}") ;;
    *) MATRIX_TESTS=("${TORCH_SURFACES[@]}") ;;
  esac
}
matrix_unit() {  # the unit tests of matrix point $1, into MATRIX_UNIT
  case "$1" in
    transformers-4.57) MATRIX_UNIT=("${TRANSFORMERS_UNIT[@]}") ;;
    *) MATRIX_UNIT=(tests/unit) ;;
  esac
}

check() {  # pytest exits 5 when it collected no tests: a failure here
  if [ "$1" -eq 5 ]; then
    echo "pytest collected no tests ($2): treating that as a failure" >&2
    return 1
  fi
  return "$1"
}

versions() {  # "$1: torch 2.13.0+cpu, transformers ..." from the environment's installed distributions
  "$2" - "$1" <<'EOF'
import sys
from importlib.metadata import version
names = ("torch", "transformers", "deepspeed", "megatron-core", "accelerate", "tokenizers")
print(f"== {sys.argv[1]}: python {sys.version.split()[0]}, " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
}

workers=${SMP_TEST_WORKERS:-2}
DIST_ARGS=()  # the distributed tier's pytest workers (see 1b)
[ "$workers" -gt 1 ] && DIST_ARGS=(-n "$workers" --dist loadfile)

matrix_points() {  # the constraints files the matrix runs
  local file
  for file in constraints/*.txt; do
    if [ "$file" = constraints/newest-torch.txt ] && [ "${SMP_TEST_NEWEST_TORCH:-0}" = 0 ]; then
      echo "== matrix newest-torch: left out (SMP_TEST_NEWEST_TORCH=1 runs it)" >&2
      continue
    fi
    echo "$file"
  done
}

BACKGROUND_DIR=$(mktemp -d)
trap 'rm -rf "$BACKGROUND_DIR"' EXIT

matrix_prepare() {  # each point's environment and unit tier; its environment's path into $BACKGROUND_DIR/<name>.env
  local status=0 file name env started part
  for file in $(matrix_points); do
    name=$(basename "$file" .txt)
    started=$SECONDS
    if ! env=$(bash scripts/setup.sh "$file"); then
      echo "matrix $file: setup failed" >&2
      status=1
      continue
    fi
    echo "$env" >"$BACKGROUND_DIR/$name.env"
    versions "matrix $name" "$env/bin/python"
    echo "== matrix $name: environment ready in $((SECONDS - started)) s"
    matrix_unit "$name"
    "$env/bin/python" "${PYTEST_ARGS[@]}" "${MATRIX_UNIT[@]}"
    check $? "matrix $file: ${MATRIX_UNIT[*]}"; part=$?
    [ "$part" -eq 0 ] || status=1
    echo "== matrix $name: unit tier done, $((SECONDS - started)) s after its setup began"
  done
  return "$status"
}

matrix_distributed() {  # each prepared point's distributed tests (MATRIX_TESTS)
  local status=0 file name env started part
  for file in $(matrix_points 2>/dev/null); do
    name=$(basename "$file" .txt)
    [ -f "$BACKGROUND_DIR/$name.env" ] || continue  # its setup failed: counted by matrix_prepare
    env=$(cat "$BACKGROUND_DIR/$name.env")
    started=$SECONDS
    matrix_tests "$name"
    "$env/bin/python" "${PYTEST_ARGS[@]}" "${MATRIX_TESTS[@]}" "${DIST_ARGS[@]}"
    check $? "matrix $file: ${MATRIX_TESTS[*]}"; part=$?
    [ "$part" -eq 0 ] || status=1
    echo "== matrix $name: distributed tests $((SECONDS - started)) s"
  done
  return "$status"
}

if [ "${1:-}" = "--matrix" ]; then
  matrix_prepare; prepared=$?
  matrix_distributed; distributed=$?
  matrix=$(( prepared || distributed ))
  echo "support matrix exit $matrix"
  exit "$matrix"
fi

bash scripts/setup.sh || exit 1
if [ "$#" -gt 0 ]; then
  .venv/bin/python "${PYTEST_ARGS[@]}" "$@"
  check $? "$*"
  exit $?
fi
versions "default stack" .venv/bin/python
# The matrix's environments and unit tiers run beside the default stack's unit and distributed tiers:
# building an environment waits mostly on the network and the disk (about two minutes on a fresh
# machine), and a unit tier is one process, which leaves one of the two cores free (its hostile-input
# budgets are CPU seconds, not wall-clock). Its output is shown when the default stack is done; its
# distributed tests run after the default stack's (two workers each would oversubscribe the cores).
matrix_on=0
[ "${SMP_TEST_MATRIX:-1}" != 0 ] && matrix_on=1
if [ "$matrix_on" = 1 ]; then
  (matrix_prepare; echo $? >"$BACKGROUND_DIR/prepare.status") >"$BACKGROUND_DIR/prepare.log" 2>&1 &
  prepare_pid=$!
fi
# the SageMaker toolkit tests' environment (pip installs, cached per test environment) likewise
.venv/bin/python tests/distributed/sagemaker_job.py --prepare >"$BACKGROUND_DIR/toolkit.log" 2>&1 &
toolkit_pid=$!
.venv/bin/python "${PYTEST_ARGS[@]}" tests/unit tests/gpu
check $? "tests/unit tests/gpu"; unit=$?
wait "$toolkit_pid" || { echo "building the toolkit tests' environment failed (the tests build it again and say why):"; tail -5 "$BACKGROUND_DIR/toolkit.log"; }
.venv/bin/python "${PYTEST_ARGS[@]}" tests/distributed "${DIST_ARGS[@]}"
check $? "tests/distributed"; distributed=$?
matrix=0
if [ "$matrix_on" = 1 ]; then
  wait "$prepare_pid"
  echo "== support matrix: environments and unit tiers (run beside the default stack) =="
  cat "$BACKGROUND_DIR/prepare.log"
  [ "$(cat "$BACKGROUND_DIR/prepare.status" 2>/dev/null)" = 0 ] || matrix=1
  matrix_distributed || matrix=1
fi
echo "default stack: unit tier exit $unit, distributed tier exit $distributed; support matrix exit $matrix"
[ "$unit" -eq 0 ] && [ "$distributed" -eq 0 ] && [ "$matrix" -eq 0 ]
