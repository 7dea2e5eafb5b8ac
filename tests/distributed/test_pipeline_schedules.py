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
import torch
from launch_util import run_ranks
from test_pipeline import SCRIPT, _check, _run
from train_pp_common import reference

SCHEDULES = [("interleaved_1f1b", {}), ("zero_bubble", {}), ("zero_bubble", {"virtual_pipeline_degree": 2}),
             ("zbv", {}), ("dualpipev", {})]
IDS = ["interleaved_1f1b", "zb_h1", "zb_v2", "zbv", "dualpipev"]


def _options(schedule, extra, **kw):
    return {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "pipeline": schedule, **extra, **kw}


@pytest.mark.parametrize("schedule,extra", SCHEDULES, ids=IDS)
def test_six_layers_sgd_pp2(tmp_path, schedule, extra):
    """Six Linear layers cut into 2 x v stages; SGD; an eval step between training steps. Under ZB-H1
    and zbv layers 3 and 4 share one weight ("sixtied"), both uses inside one stage whose backward is
    split (pytorch #180952: such a weight's gradient counted twice by the weight-gradient step)."""
    model = "sixtied" if IDS[SCHEDULES.index((schedule, extra))] in ("zb_h1", "zbv") else "six"
    results = _run(tmp_path, model, 2, _options(schedule, extra), steps=2)
    _check(results, model, 4)
    v = 1 if schedule == "zero_bubble" and not extra else 2
    log0 = (tmp_path / "log0.txt").read_text()
    assert f"Partition assignments (auto, {2 * v} stages" in log0


def test_gpt2_tied_embeddings_pp2_dp2_zb_h1(tmp_path):
    """Tiny GPT2LMHeadModel (wte tied to lm_head), pp 2 x dp 2, ZB-H1 (split backward), SGD, with
    shard_optimizer_state (each dp rank steps its share of the stage's parameters and broadcasts
    them): losses and final weights equal one process; the tied weight's two uses are on two ranks
    (summed over them)."""
    options = _options("zero_bubble", {}, microbatches=2, shard_optimizer_state=True)
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


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_seed_convnet_pp2_tp2_four_stages(tmp_path, schedule):
    """The seed's conv + linear Net, pp 2 x tp 2 (fc1 split: Megatron-core's linear autograd function),
    4 stages (2 per rank), SGD. Under zbv the backward is split: fc1's stage (2, on rank 1) runs the
    input-gradient step and later the weight-gradient step through the TP layer, and stage 1's output
    is torch.flatten's view, which torch's input-gradient step cannot detach in place (copied:
    surgery.OwnViewOutputs). Mutation: with the weight-gradient step skipped the step-2 loss is off by
    7e-4 relative; without the copy every rank fails with "Can't detach views in-place"."""
    options = _options(schedule, {}, tensor_parallel_degree=2)
    results = _run(tmp_path, "net", 4, options)
    _check(results, "net", 4)
    log0 = (tmp_path / "log0.txt").read_text()
    assert "Partition assignments (auto, 4 stages" in log0 and "fc1 -> 2 (rank" in log0


def test_zbv_fp16_clipping_activation_checkpointing(tmp_path):
    """zbv (V order, split backward) with fp16 (fp32 masters, static loss scale), clip_master_grads and
    every layer activation-checkpointed, SGD: the same as the fp16 recipe written out in one process
    (train_pp_common.reference): losses and weights to the last bit (the same fp16 operations in the
    same order; measured), the global gradient norm within 1e-6 (the reference sums in fp32 in another
    order). Under 1F1B the same run is test_pipeline.py's clipping test."""
    cli = ["--steps", 3, "--optimizer", "sgd", "--loss-scale", "static:128", "--clip", 0.05, "--act-ckpt"]
    results = run_ranks(SCRIPT, 2, args=["--model", "six", *cli], out_dir=tmp_path, timeout=200,
                        env={"SM_HP_MP_PARAMETERS": json.dumps(_options("zbv", {}, fp16=True))})
    norms = []
    ref_losses, ref_state = reference("six", 3, 8, 4, "sgd", torch.float16, 128.0, clip=0.05, norms=norms)
    for r in results:
        assert r["losses"] == ref_losses and r["overflows"] == [False] * 3
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(norms), rtol=1e-6, atol=0.0)
    assert norms[0] > 0.05  # every step clipped
    for name, ref in ref_state.items():
        assert torch.equal(torch.tensor(results[0]["final_state"][name]), ref.float()), name
    logs = (tmp_path / "log0.txt").read_text() + (tmp_path / "log1.txt").read_text()
    assert "Activation checkpointing in the stage(s) of pipeline rank 0: layers.0, layers.1, layers.4, layers.5" in logs
    assert "Activation checkpointing in the stage(s) of pipeline rank 1: layers.2, layers.3" in logs
