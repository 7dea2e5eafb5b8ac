"""Hostile or absurd input ends in well under a second with an SMPConfigError (exit 2 at the CLI)
that names the key and the limit, and a short message: nothing is built for a world of ten million
processes, YAML aliases are not expanded into gigabytes, a huge value is quoted by a short prefix.

Time budget per case: 1 s in-process (the work is O(input size) checks; the slowest case, 100,000
nested brackets, takes about 0.2 s on the 2-core CI machine)."""

from __future__ import annotations

import time

import pytest

from smp_adapter.cli import main
from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.distribution import load_job, parse_inline_or_file
from smp_adapter.config.layout import RankGrid
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPConfigError

BUDGET_S = 1.0

BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
"""


def _refused(call, *fragments):
    start = time.process_time()  # CPU seconds, not wall-clock: shared cores must not fail the budget
    with pytest.raises(SMPConfigError) as err:
        call()
    elapsed = time.process_time() - start
    message = str(err.value)
    assert elapsed < BUDGET_S, f"took {elapsed:.2f} s"
    assert len(message) < 2000, f"message of {len(message)} characters"
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("degree", [100_000, 10_000_000, 10**18])
def test_huge_degrees_are_refused_before_anything_is_built(degree):
    _refused(lambda: SMPConfig.from_dict({"ddp": True, "tensor_parallel_degree": degree}),
             f"tensor_parallel_degree = {degree}: must be <= 65536", "MAX_DEGREE")


def test_a_huge_world_is_refused_naming_the_limit():
    _refused(lambda: ParallelDims.from_config(SMPConfig.from_dict({"ddp": True}), 10**8),
             "world_size = 100000000: must be <= 65536", "MAX_WORLD_SIZE")


def test_rank_grid_of_the_largest_world_answers_without_building_it():
    start = time.process_time()  # CPU seconds: the machine's load must not fail it
    grid = RankGrid.from_degrees(MAX_WORLD_SIZE, pp=8, tp=8, placement="cluster")
    coord = grid.coord(MAX_WORLD_SIZE - 1)
    assert (coord.rdp, coord.pp, coord.tp) == (grid.rdp - 1, 7, 7)
    assert grid.tp_group(9) == tuple(range(8, 16))
    assert len(grid.rdp_group(0)) == grid.rdp
    assert time.process_time() - start < 0.05  # arithmetic on the asked-for ranks only


def test_yaml_alias_bomb_is_refused_with_a_short_message(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    _refused(lambda: load_job(str(path)), "bomb.yaml", "YAML aliases", "MAX_DOCUMENT_NODES")


def test_deep_nesting_is_refused_inline_and_in_files(tmp_path):
    _refused(lambda: parse_inline_or_file("[" * 100_000), "INPUT: nests deeper than 64 levels")
    deep = '{"a": ' * 200 + "1" + "}" * 200
    _refused(lambda: parse_inline_or_file(deep), "INPUT: nests deeper than 64 levels")
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 100_000)
    _refused(lambda: load_job(str(path)), "deep.yaml")


def test_a_huge_value_is_quoted_by_a_short_prefix():
    value = [list(range(1000))] * 1000
    message = _refused(lambda: SMPConfig.from_dict({"ddp": True, "tensor_parallel": value}),
                       "tensor_parallel = [[0, 1, 2, 3, 4, 5, ...]", "unknown smp option")
    assert "999" not in message


def test_inline_json_that_is_not_an_object_says_so():
    for text, kind in (("[1, 2]", "list"), ("3", "int"), ('"ddp"', "str"), ("null", "NoneType")):
        _refused(lambda: parse_inline_or_file(text), f"options must be a JSON object ({{...}}), got a JSON {kind}")


def _cli_refused(argv, *fragments, capsys):
    start = time.process_time()  # CPU seconds (the command runs in this process), not wall-clock
    code = main(argv)
    elapsed = time.process_time() - start
    err = capsys.readouterr().err
    assert code == 2 and elapsed < BUDGET_S, (code, elapsed, err[-500:])
    assert len(err) < 2000 and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def test_cli_cases_from_the_issue(tmp_path, capsys):
    _cli_refused(["translate", '{"ddp": true, "tensor_parallel_degree": 10000000}'],
                 "tensor_parallel_degree = 10000000: must be <= 65536", capsys=capsys)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    _cli_refused(["translate", str(bomb)], "MAX_DOCUMENT_NODES", capsys=capsys)
    _cli_refused(["translate", "[1, 2]"], "options must be a JSON object", capsys=capsys)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for flag, value in (("--nproc-per-node", "0"), ("--nproc-per-node", "-2"), ("--nnodes", "0"),
                        ("--nproc-per-node", str(MAX_WORLD_SIZE + 1))):
        _cli_refused(["launch", flag, value, "--dry-run", "--options", '{"ddp": true}', str(script)],
                     f"{flag} = {value}: must be an integer between 1 and 65536", capsys=capsys)
