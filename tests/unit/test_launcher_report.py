"""The launcher's failure summary (smp_adapter/launch/supervisor.py, Supervisor.report) from what it saw of
the ranks, without starting any: which rank is blamed and which exit status the command returns."""

import io
import signal

import pytest

from smp_adapter.launch.supervisor import Supervisor

SYNTAX = ['  File "/job/broken.py", line 3', "    def broken(:", "               ^", "SyntaxError: invalid syntax"]


def _supervisor(seen: dict[int, list[str]], exits: dict[int, int]) -> Supervisor:
    sup = Supervisor(["true"], {}, "deepspeed", out=io.StringIO())
    for rank, lines in seen.items():
        for line in lines:
            sup.emit(line, rank)
    sup.exits.update(exits)
    sup.stop_delay = 2.0  # set by run(): seconds from the first failure to the last rank's end
    return sup


def test_a_rank_stopped_on_its_way_out_reports_the_launchers_status(capsys):
    # every rank hit the same syntax error; rank 0 exited (1) before the supervisor watched it, rank 1
    # printed the error and then met the launcher's SIGTERM (seen in CI: the command returned 143)
    sup = _supervisor({1: SYNTAX}, {1: -signal.SIGTERM})
    assert sup.report(1) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed (exit code 1): SyntaxError: invalid syntax (File \"/job/broken.py\", line 3)" in err


def test_when_the_launcher_itself_was_stopped_the_printed_error_still_decides(capsys):
    # the same race, with the launcher process ended by the supervisor's SIGTERM as well (its status 143)
    sup = _supervisor({1: SYNTAX}, {1: -signal.SIGTERM})
    assert sup.report(128 + signal.SIGTERM) == 1
    assert "rank 1 failed (exit code 1): SyntaxError" in capsys.readouterr().err


def test_the_rank_that_raised_is_blamed_not_the_one_stopped_after(capsys):
    sup = _supervisor({0: ["Traceback (most recent call last):", "ValueError: bad batch"], 1: []},
                      {0: 1, 1: -signal.SIGTERM})
    assert sup.report(1) == 1
    assert "rank 0 failed (exit code 1): ValueError: bad batch" in capsys.readouterr().err


@pytest.mark.parametrize("launcher_code", [0, 143])
def test_a_silent_sigterm_keeps_its_signal_status(capsys, launcher_code):
    # nothing printed: the rank was killed from outside; its status stays 128 + 15
    sup = _supervisor({1: []}, {1: -signal.SIGTERM})
    sup.failure = (1, -signal.SIGTERM)
    assert sup.report(launcher_code) == 128 + signal.SIGTERM
    assert "killed by signal SIGTERM" in capsys.readouterr().err
