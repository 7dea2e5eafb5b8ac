"""The sdp-engine choice (pp 1 and 1 < sdp < rdp: MiCS or ZeRO-3 + hpZ) has one home,
config/dims.ParallelDims (sdp_below_rdp, chooses_sdp_engine, sdp_engine_note); every other module asks it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from smp_adapter.config.dims import SDP_ENGINE_ENV, ParallelDims
from smp_adapter.config.options import SMPConfig

ADAPTER = Path(__file__).resolve().parents[2] / "adapter"


def _dims(world, engine="mics", **options):
    return ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, **options}), world, engine)


@pytest.mark.parametrize("world, options, below, chooses", [
    (4, {"sharded_data_parallel_degree": 2}, True, True),
    (4, {"sharded_data_parallel_degree": 4}, False, False),  # sdp == rdp: plain ZeRO-3
    (2, {}, False, False),
    (8, {"sharded_data_parallel_degree": 4}, True, True),
])
def test_the_rule(world, options, below, chooses):
    dims = _dims(world, **options)
    assert dims.sdp_below_rdp is below
    assert dims.chooses_sdp_engine is chooses
    assert (dims.sdp_engine_note() is not None) is chooses


def test_the_note_names_the_engine_that_runs_and_the_other():
    mics = _dims(4, "mics", sharded_data_parallel_degree=2)
    hpz = _dims(4, "hpz", sharded_data_parallel_degree=2)
    assert (mics.engine, hpz.engine) == ("mics", "deepspeed")
    assert "MiCS" in mics.sdp_engine_note() and f"{SDP_ENGINE_ENV}=hpz" in mics.sdp_engine_note()
    assert "hpZ" in hpz.sdp_engine_note() and "unset it" in hpz.sdp_engine_note()
    assert hpz.hpz_partition_size == 2 and mics.hpz_partition_size == 1


def _writes_the_rule(node) -> bool:
    """``1 < <x>.sdp < <y>.rdp`` (or with bare names sdp / rdp) written out."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 2 and all(isinstance(o, ast.Lt) for o in node.ops)):
        return False
    names = [n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in node.comparators]
    return isinstance(node.left, ast.Constant) and node.left.value == 1 and names == ["sdp", "rdp"]


def test_no_second_home():
    homes = []
    for path in sorted(ADAPTER.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        homes += [f"{path.relative_to(ADAPTER)}:{n.lineno}" for n in ast.walk(tree) if _writes_the_rule(n)]
    assert homes == ["smp_adapter/config/dims.py:" + str(_line_of_rule())], homes


def _line_of_rule() -> int:
    source = (ADAPTER / "smp_adapter/config/dims.py").read_text()
    return next(i for i, line in enumerate(source.splitlines(), 1) if "return 1 < self.sdp < self.rdp" in line)
