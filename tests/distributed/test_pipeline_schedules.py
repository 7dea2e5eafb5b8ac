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


def test_gpt2_tied_embeddings_pp2_dp2_zb_h1(tmp_path):
    """Tiny GPT2LMHeadModel (wte tied to lm_head), pp 2 x dp 2, ZB-H1 (split backward), SGD: losses and
    final weights equal one process; the tied weight's two uses are on two ranks (summed over them)."""
    options = _options("zero_bubble", {}, microbatches=2)
    results = run_ranks(SCRIPT, 4, args=["--model", "gpt2", "--steps", 2, "--optimizer", "sgd", "--final-state"],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=300)
    _check(results, "gpt2", 2)


def test_gpt2_four_stages_refused_with_the_fix(tmp_path):
    """GPT-2 cut into 4 stages passes values past a stage (the residual stream), which torch's
    multi-stage schedules cannot: every rank raises UnsupportedFeatureError naming the fix."""
    options = _options("zbv", {}, microbatches=2)
    with pytest.raises(AssertionError) as e:
        run_ranks(SCRIPT, 2, args=["--model", "gpt2", "--steps", 1], env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                  out_dir=tmp_path, timeout=200)
    assert str(e.value).count("UnsupportedFeatureError: pipeline: zbv cannot run GPT2LMHeadModel") == 2
    assert "Use pipeline: zero_bubble (one stage per rank) or interleaved" in str(e.value)


def test_seed_convnet_pp2_tp2_interleaved_1f1b(tmp_path):
    """The seed's conv + linear Net, pp 2 x tp 2 (fc1 split), 4 stages (2 per rank), SGD."""
    options = _options("interleaved_1f1b", {}, tensor_parallel_degree=2)
    results = _run(tmp_path, "net", 4, options)
    _check(results, "net", 4)
