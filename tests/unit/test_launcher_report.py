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


ABORT = ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
         "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 65536 vs 4."]
CAUSE = ("SMPCheckpointError: checkpoint save to /ckpt failed writing /ckpt/.step4_partial.tmp/ds/x.pt: No space left "
         "on device (errno ENOSPC); free space on that file system: 0 bytes.")


def test_a_rank_killed_before_it_printed_is_named_with_the_cause_it_wrote(capsys, tmp_path):
    # issue 63: rank 0 wrote its cause, then gloo aborted it (SIGABRT) before the error was printed
    (tmp_path / "rank0.txt").write_text(CAUSE + "\n")
    sup = _supervisor({0: ABORT, 1: []}, {0: -signal.SIGABRT, 1: -signal.SIGTERM})
    sup.cause_dir = tmp_path
    sup.failure = (0, -signal.SIGABRT)
    assert sup.report(1) == 128 + signal.SIGABRT
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"smp-adapter launch: rank 0 failed first, and wrote before it stopped: {CAUSE}"


def test_the_first_written_cause_is_named_when_the_rank_blamed_only_relays_it(capsys, tmp_path):
    (tmp_path / "rank1.txt").write_text(CAUSE + "\n")
    relayed = f"SMPCheckpointError: rank 1 failed, so every rank stops here: {CAUSE[len('SMPCheckpointError: '):]}"
    sup = _supervisor({0: ["Traceback (most recent call last):", relayed]}, {0: 1})
    sup.cause_dir = tmp_path
    assert sup.report(1) == 1
    err = capsys.readouterr().err
    assert "rank 0 failed (exit code 1): SMPCheckpointError: rank 1 failed, so every rank stops here" in err
    assert err.splitlines()[-1] == f"smp-adapter launch: rank 1 failed first, and wrote before it stopped: {CAUSE}"


def test_a_cause_the_summary_quotes_already_is_not_repeated(capsys, tmp_path):
    (tmp_path / "rank0.txt").write_text(CAUSE + "\n")
    sup = _supervisor({0: ["Traceback (most recent call last):", f"smp_adapter.errors.{CAUSE}"]}, {0: 1})
    sup.cause_dir = tmp_path
    assert sup.report(1) == 1
    assert "wrote before it stopped" not in capsys.readouterr().err
