#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on CPU (this is .ci/run).
#
# With no arguments, two pytest runs:
#   1. tests/unit and tests/gpu, one process: the hostile-input cases hold 1-2 s wall-clock budgets,
#      which another test's ranks on the same two cores could break;
#   2. tests/distributed on two pytest workers (pytest-xdist, a test file per worker at a time, so a
#      module's cached sources are built once): its ranks spend much of their time waiting on each
#      other (gloo, pipeline stages, launcher start-up), and one worker left ~40 % of the two cores
#      idle. SMP_TEST_WORKERS=1 runs it in one process.
# With arguments, one pytest run over them (e.g. a single file while developing).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)

check() {  # pytest exits 5 when it collected no tests: a failure here
  if [ "$1" -eq 5 ]; then
    echo "pytest collected no tests ($2): treating that as a failure" >&2
    return 1
  fi
  return "$1"
}

if [ "$#" -gt 0 ]; then
  "${PYTEST[@]}" "$@"
  check $? "$*"
  exit $?
fi
"${PYTEST[@]}" tests/unit tests/gpu
check $? "tests/unit tests/gpu"; unit=$?
workers=${SMP_TEST_WORKERS:-2}
if [ "$workers" -gt 1 ]; then
  "${PYTEST[@]}" tests/distributed -n "$workers" --dist loadfile
else
  "${PYTEST[@]}" tests/distributed
fi
check $? "tests/distributed"; distributed=$?
echo "unit tier exit $unit, distributed tier exit $distributed"
[ "$unit" -eq 0 ] && [ "$distributed" -eq 0 ]
