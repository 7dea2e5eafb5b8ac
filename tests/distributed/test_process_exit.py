"""A rank whose script finished must exit 0, whatever gloo work its engines left in flight
(runtime/process_exit.py). Reference: before that module, 5 of 6 runs of this script ended with
SIGABRT on this machine."""

from pathlib import Path

from aws_style import launch
from launch_util import ROOT

SCRIPT = ROOT / "tests/distributed/scripts/unwaited_async_work.py"


def test_ranks_with_unwaited_async_work_exit_cleanly(tmp_path: Path):
    for attempt in range(2):  # the abort was a race: two runs make a regression all but certain to show
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        result = launch(SCRIPT, 2, {}, run_dir, timeout=120)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert "terminate called" not in output, output[-4000:]
        assert "rank 0 finished its script" in output and "rank 1 finished its script" in output, output[-4000:]
