#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
.venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$code"
