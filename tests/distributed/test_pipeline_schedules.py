"""The pipeline schedules past 1F1B (pipeline: interleaved_1f1b | zero_bubble | zbv | dualpipev,
config/pipeline_schedule.py) give the same training as one process: the 1F1B tests of
test_pipeline.py, parametrised over the schedules, on CPU/gloo.

Losses and final weights (gathered with model.state_dict(), so every stage's gradient and update)
equal the single-process plain-PyTorch run within 1e-5 relative (fp32 sums in another order).
SGD runs are the ones that catch a uniformly scaled gradient (Adam normalises it away): a weight
gradient counted twice or skipped by the split backward changes the SGD update.
"""

import json

import pytest
from launch_util import run_ranks
from test_pipeline import SCRIPT, _check, _run

SCHEDULES = [("interleaved_1f1b", {}), ("zero_bubble", {}), ("zero_bubble", {"virtual_pipeline_degree": 2}),
             ("zbv", {}), ("dualpipev", {})]
IDS = ["interleaved_1f1b", "zb_h1", "zb_v2", "zbv", "dualpipev"]


def _options(schedule, extra, **kw):
    return {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "pipeline": schedule, **extra, **kw}


@pytest.mark.parametrize("schedule,extra", SCHEDULES, ids=IDS)
def test_six_layers_sgd_pp2(tmp_path, schedule, extra):
    """Six Linear layers cut into 2 x v stages; SGD; an eval step between training steps."""
    results = _run(tmp_path, "six", 2, _options(schedule, extra), steps=2)
    _check(results, "six", 4)
    v = 1 if schedule == "zero_bubble" and not extra else 2
    log0 = (tmp_path / "log0.txt").read_text()
    assert f"Partition assignments (auto, {2 * v} stages" in log0
