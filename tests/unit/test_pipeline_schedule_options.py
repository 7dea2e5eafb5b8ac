"""The smp-adapter pipeline schedules (pipeline: interleaved_1f1b | zero_bubble | zbv | dualpipev):
option rules, each refused with one SMPConfigError naming the key and the fix, and the stage order."""

from __future__ import annotations

import pytest

from smp_adapter.config.options import SMPConfig
from smp_adapter.config.pipeline_schedule import stage_ranks
from smp_adapter.errors import SMPConfigError


def cfg(**kw):
    return SMPConfig.from_dict({"pipeline_parallel_degree": 2, "microbatches": 4, **kw})


@pytest.mark.parametrize("schedule,v", [("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2),
                                        ("interleaved", 1), ("simple", 1)])
def test_default_virtual_degree(schedule, v):
    assert cfg(pipeline=schedule).virtual_pipeline_degree == v


def test_given_virtual_degree():
    assert cfg(pipeline="interleaved_1f1b", virtual_pipeline_degree=3, microbatches=6).virtual_pipeline_degree == 3
    assert cfg(pipeline="zero_bubble", virtual_pipeline_degree=2).virtual_pipeline_degree == 2


BAD = [
    ({"pipeline": "interleaved", "virtual_pipeline_degree": 2},
     r"virtual_pipeline_degree = 2: only applies to pipeline: interleaved_1f1b or zero_bubble .*not to pipeline: "
     r"interleaved\. Fix: remove virtual_pipeline_degree, or set pipeline: interleaved_1f1b"),
    ({"pipeline": "interleaved_1f1b", "virtual_pipeline_degree": 1},
     r"virtual_pipeline_degree = 1: must be >= 2 with pipeline: interleaved_1f1b .*Fix: use virtual_pipeline_degree: 2, "
     r"or pipeline: interleaved"),
    ({"pipeline": "zbv", "virtual_pipeline_degree": 3},
     r"virtual_pipeline_degree = 3: must be 2 with pipeline: zbv .*Fix: remove virtual_pipeline_degree"),
    ({"pipeline": "zero_bubble", "microbatches": 1},
     r"microbatches = 1: must be >= pipeline_parallel_degree \(2\) with pipeline: zero_bubble .*Fix: use microbatches "
     r">= 2, or pipeline: simple"),
    ({"pipeline": "interleaved_1f1b", "microbatches": 5},
     r"microbatches = 5: must be a multiple of its number of rounds \(microbatches // pipeline_parallel_degree = 2\) "
     r".*Fix: use microbatches: 4 or 6"),
    ({"pipeline": "dualpipev", "microbatches": 3},
     r"microbatches = 3: must be >= 2 x pipeline_parallel_degree \(4\) with pipeline: dualpipev .*Fix: use "
     r"microbatches >= 4, or pipeline: zbv"),
    ({"pipeline": "zbv", "active_microbatches": 2},
     r"active_microbatches = 2: cannot bound pipeline: zbv.*Fix: remove active_microbatches .*or use pipeline: "
     r"interleaved"),
    ({"pipeline": "zbv", "auto_partition": False, "default_partition": 0},
     r"auto_partition = False: must be true with pipeline: zbv and virtual_pipeline_degree 2: smp.partition / "
     r"set_partition name a pipeline rank.*Fix: set auto_partition: true .*or keep the marks with pipeline: zero_bubble"),
    ({"pipeline": "pipedream"}, r"pipeline = 'pipedream': must be one of interleaved, simple, _only_forward, "
     r"interleaved_1f1b, zero_bubble, zbv, dualpipev"),
]


@pytest.mark.parametrize("raw,message", BAD)
def test_bad_schedule_options(raw, message):
    with pytest.raises(SMPConfigError, match=message):
        cfg(**raw)


def test_all_problems_in_one_error():
    with pytest.raises(SMPConfigError) as e:
        cfg(pipeline="dualpipev", microbatches=3, active_microbatches=1, virtual_pipeline_degree=4)
    text = str(e.value)
    assert "virtual_pipeline_degree = 4" in text and "microbatches = 3" in text and "active_microbatches = 1" in text


def test_pp1_ignores_the_schedule():
    # a pipeline script debugged at pipeline_parallel_degree 1 runs unchanged (as smp's own values)
    assert SMPConfig.from_dict({"pipeline": "dualpipev", "microbatches": 1}).pipeline == "dualpipev"


def test_manual_partition_with_one_stage_per_rank():
    assert cfg(pipeline="zero_bubble", auto_partition=False, default_partition=0).auto_partition is False


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_split_backward_with_tensor_parallelism(schedule):
    # the split input/weight backward runs through the TP layers' autograd functions (tested at pp 2 x tp 2
    # in tests/distributed/test_pipeline_schedules.py)
    assert cfg(pipeline=schedule, tensor_parallel_degree=2, ddp=True).tensor_parallel_degree == 2


def test_active_microbatches_equal_to_microbatches_is_fine():
    assert cfg(pipeline="zero_bubble", active_microbatches=4).active_microbatches == 4


def test_stage_order():
    assert stage_ranks(2, 2, v_shaped=False) == [0, 1, 0, 1]
    assert stage_ranks(2, 2, v_shaped=True) == [0, 1, 1, 0]
    assert stage_ranks(3, 2, v_shaped=True) == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize("schedule,stages", [("interleaved", [0, 1]), ("zero_bubble", [0, 1]),
                                             ("interleaved_1f1b", [0, 1, 0, 1]), ("zbv", [0, 1, 1, 0])])
def test_checkpoints_record_the_stage_order(monkeypatch, schedule, stages):
    """A partial checkpoint records which rank holds each stage: one saved under a schedule with other
    stages (1F1B -> zbv) differs in layout and is read from its layout-independent pieces; one saved
    before the record existed had one stage per rank."""
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.runtime.checkpoint.files import layout_difference, layout_record
    from smp_adapter.runtime.state import state

    dims = ParallelDims.from_config(cfg(pipeline=schedule, ddp=True), 2)
    monkeypatch.setattr(state, "dims", dims)
    record = layout_record(dims)
    assert record["stages"] == stages
    assert layout_difference(record) is None
    old = {k: v for k, v in record.items() if k != "stages"}  # written before the stage order was recorded
    one_f_one_b = layout_record(ParallelDims.from_config(cfg(ddp=True), 2))
    if stages == [0, 1]:
        assert layout_difference(old) is None and layout_difference(one_f_one_b) is None
    else:
        assert layout_difference(old) == f"stages: saved [0, 1] vs now {stages}"
        assert layout_difference(one_f_one_b) == f"stages: saved [0, 1] vs now {stages}"
