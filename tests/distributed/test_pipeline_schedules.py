"""The pipeline schedules past 1F1B (pipeline: interleaved_1f1b | zero_bubble | zbv | dualpipev,
config/pipeline_schedule.py) give the same training as one process: the 1F1B tests of
test_pipeline.py, parametrised over the schedules, on CPU/gloo.

Losses and final weights (gathered with model.state_dict(), so every stage's gradient and update)
equal the single-process plain-PyTorch run within 1e-5 relative (fp32 sums in another order).
SGD runs are the ones that catch a uniformly scaled gradient (Adam normalises it away): a weight
gradient counted twice or skipped by the split backward changes the SGD update.

The schedule x layout matrix, cell by cell (2 training steps; pp 2 is 2 ranks, pp 2 x dp 2 and
pp 2 x tp 2 are 4). Models: gpt2 = tiny GPT2LMHeadModel with tied embeddings, whose causal mask is
read past the next stage when cut into 4 stages (at pp 2 x tp 2 its layers split over the TP ranks);
net = the seed's conv + linear net, fc1 split by TP; six = six Linear layers (sixtied, layers 3 and 4
sharing a weight, under ZB-H1 and zbv at pp 2); skip = train_pp_common.SkipNet, a float value read past
the next stage.
* interleaved_1f1b: pp 2: six, test_six_layers_sgd_pp2; pp 2 x dp 2: gpt2,
  test_gpt2_tied_embeddings_every_schedule; pp 2 x tp 2: net, test_seed_convnet_pp2_tp2.
* zero_bubble (ZB-H1, v = 1): pp 2: six, test_six_layers_sgd_pp2; pp 2 x dp 2: gpt2 with
  shard_optimizer_state, test_gpt2_tied_embeddings_every_schedule; pp 2 x tp 2: net, test_seed_convnet_pp2_tp2.
* zero_bubble, v = 2: pp 2: six, test_six_layers_sgd_pp2; pp 2 x dp 2: skip, test_float_values_crossing_stages;
  pp 2 x tp 2: gpt2, test_gpt2_tied_embeddings_every_schedule.
* zbv: pp 2: six, test_six_layers_sgd_pp2 and (fp16, clipping, activation checkpointing)
  test_zbv_fp16_clipping_activation_checkpointing; pp 2 x dp 2: gpt2, test_gpt2_tied_embeddings_every_schedule;
  pp 2 x tp 2: net, test_seed_convnet_pp2_tp2.
* dualpipev: pp 2: six, test_six_layers_sgd_pp2; pp 2 x dp 2: skip, test_float_values_crossing_stages;
  pp 2 x tp 2: gpt2, test_gpt2_tied_embeddings_every_schedule.

Elsewhere: test_pipeline.py runs bf16 under zbv and resumes a 1F1B checkpoint under zbv (six, pp 2);
test_float_values_crossing_stages also runs skip at pp 4 under 1F1B (smp's `interleaved`).
"""

import json

import pytest
import torch
from launch_util import run_ranks
from test_pipeline import RTOL, SCRIPT, _check, _run
from train_pp_common import build, reference

from smp_adapter.config.pipeline_schedule import SPLIT_BACKWARD
from smp_adapter.runtime.engines.pipeline.torch_compat import SCHEDULE_MIN_TORCH, older_than

# the split-backward schedules are refused on torch < 2.13 (torch_compat.py): their tests run on a newer
# torch, and test_split_backward_schedules_or_their_refusal checks the refusal on an older one
SPLIT_BACKWARD_REFUSED = older_than(*SCHEDULE_MIN_TORCH["zbv"])

SCHEDULES = [("interleaved_1f1b", {}), ("zero_bubble", {}), ("zero_bubble", {"virtual_pipeline_degree": 2}),
             ("zbv", {}), ("dualpipev", {})]
IDS = ["interleaved_1f1b", "zb_h1", "zb_v2", "zbv", "dualpipev"]


def _options(schedule, extra, **kw):
    if schedule in SPLIT_BACKWARD and SPLIT_BACKWARD_REFUSED:
        pytest.skip(f"pipeline: {schedule} is refused on torch {torch.__version__} (needs 2.13)")
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


TP2 = {"tensor_parallel_degree": 2}  # 4 ranks: pp 2 x tp 2 (GPT-2 created inside smp.tensor_parallelism())
DP2 = {}  # 4 ranks: pp 2 x dp 2
GPT2_CELLS = [  # (schedule, its options, the layout's options); see the matrix in the module docstring
    pytest.param("zero_bubble", {}, {**DP2, "shard_optimizer_state": True}, id="zb_h1-pp2xdp2-sharded"),
    pytest.param("interleaved_1f1b", {}, DP2, id="interleaved_1f1b-pp2xdp2"),
    pytest.param("zbv", {}, DP2, id="zbv-pp2xdp2-delayed"),  # the model created under delayed initialisation
    pytest.param("dualpipev", {}, TP2, id="dualpipev-pp2xtp2-delayed"),
    pytest.param("zero_bubble", {"virtual_pipeline_degree": 2}, TP2, id="zb_v2-pp2xtp2"),
]


@pytest.mark.parametrize("schedule,extra,layout", GPT2_CELLS)
def test_gpt2_tied_embeddings_every_schedule(tmp_path, schedule, extra, layout):
    """Tiny GPT2LMHeadModel (wte tied to lm_head, held by the first and the last stage, its gradient
    summed over them), 4 ranks (at pp 2 x tp 2 created inside smp.tensor_parallelism(), so its layers
    are Megatron-core TP layers), SGD, clip_master_grads: losses, the global gradient norm before
    clipping and the final weights equal one process within 1e-5 (fp32 sums in another order).
    Cut into 4 stages (v = 2), stage 0's causal mask is read by stage 2: it is passed through
    stage 1 (pass_through.py; without it every rank failed with UnsupportedFeatureError), and the
    residual stream that stages 1 and 2 return and also layer-normalise is copied under the split
    backward (surgery.own_outputs_read_inside; without it zbv fails with "Trying to use a saved
    tensor that has been detached in-place"). ZB-H1 (2 stages) also with shard_optimizer_state
    (each dp rank steps its share of the stage's parameters and broadcasts them)."""
    microbatches = 4 if schedule == "dualpipev" else 2  # dualpipev needs microbatches >= 2 pp
    options = _options(schedule, {**extra, **layout}, microbatches=microbatches)
    clip = 0.5  # below the norms (0.8-1.2): every step clipped, so the final weights depend on the norm
    tp = ["--tp"] if layout is TP2 else []
    # zbv and dualpipev: the model is created under smp.delay_param_initialization(): no rank holds it whole,
    # each replays the creation of its two stages (tied embedding included), and the weights are the ones
    # the one-process reference builds without delaying
    delayed = ["--delayed"] if schedule in ("zbv", "dualpipev") else []
    results = run_ranks(SCRIPT, 4, args=["--model", "gpt2", "--steps", 2, "--optimizer", "sgd", "--final-state",
                                         "--clip", clip, *tp, *delayed],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=300)
    norms = []
    ref_losses, ref_state = reference("gpt2", 2, 8 * results[0]["dp_size"], microbatches, "sgd", clip=clip,
                                      norms=norms)
    assert min(norms) > clip
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0.0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(norms), rtol=RTOL, atol=0.0)
    for name, ref in ref_state.items():
        torch.testing.assert_close(torch.tensor(results[0]["final_state"][name]), ref, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    stages = 2 if schedule == "zero_bubble" and not extra else 4
    assert f"Partition assignments (auto, {stages} stages" in (tmp_path / "log0.txt").read_text()
    if tp:  # the layers are split over the TP ranks: each stage's two TP ranks hold less than it twice
        whole = sum(p.numel() * p.element_size() for p in build("gpt2").parameters())
        assert sum(r["local_bytes"] for r in results) < 2 * whole


@pytest.mark.parametrize("schedule,extra", [("dualpipev", {}), ("zero_bubble", {"virtual_pipeline_degree": 2}),
                                            ("interleaved", {"pipeline_parallel_degree": 4})],
                         ids=["dualpipev-pp2xdp2", "zb_v2-pp2xdp2", "1f1b-pp4"])
def test_float_values_crossing_stages(tmp_path, schedule, extra):
    """train_pp_common.SkipNet: layer 0's output is read by the stages of layers 1, 2 and 3 (float,
    with gradients), so it is passed through stages 1 and 2 (once each, although two later stages
    read it; in the V order stages 1 and 2 share rank 1 and hand it over in memory). 4 ranks (pp 2 x
    dp 2, or pp 4 under 1F1B, where torch's stage refused the backward of an output read by several
    stages: "Backward of skip connections not supported yet"), SGD, an evaluation step between the
    training steps: losses, final weights and the evaluation output equal one process.
    Mutation check: with the pass-through output detached (pass_through._pass_on; its gradient
    dropped) the pp 2 x dp 2 cells fail, the step-2 loss off by 1.8e-3 relative (measured)."""
    options = _options(schedule, extra, microbatches=4)
    results = _run(tmp_path, "skip", 4, options)
    _check(results, "skip", 4)
    log0 = (tmp_path / "log0.txt").read_text()
    assert "Partition assignments (auto, 4 stages" in log0 and "layers.3 -> 3" in log0


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv", "zero_bubble"])
def test_seed_convnet_pp2_tp2(tmp_path, schedule):
    """The seed's conv + linear Net, pp 2 x tp 2 (fc1 split: Megatron-core's linear autograd function),
    4 stages (2 per rank; 2 under zero_bubble, ZB-H1), SGD. Under zbv the backward is split: fc1's
    stage (2, on rank 1) runs the input-gradient step and later the weight-gradient step through the
    TP layer, and stage 1's output
    is torch.flatten's view, which torch's input-gradient step cannot detach in place (copied:
    surgery.OwnViewOutputs). Mutation: with the weight-gradient step skipped the step-2 loss is off by
    7e-4 relative; without the copy every rank fails with "Can't detach views in-place"."""
    options = _options(schedule, {}, tensor_parallel_degree=2)
    results = _run(tmp_path, "net", 4, options)
    _check(results, "net", 4)
    log0 = (tmp_path / "log0.txt").read_text()
    if schedule == "zero_bubble":  # one stage per rank: fc1's stage (1) has its backward split
        assert "Partition assignments (auto, 2 stages" in log0 and "fc1 -> 1" in log0
    else:
        assert "Partition assignments (auto, 4 stages" in log0 and "fc1 -> 2 (rank" in log0


def test_zbv_fp16_clipping_activation_checkpointing(tmp_path):
    """zbv (V order, split backward) with fp16 (fp32 masters, static loss scale), clip_master_grads and
    every layer activation-checkpointed, SGD, the model created under delayed initialisation (the fp16
    cast recorded and replayed with it): the same as the fp16 recipe written out in one process
    (train_pp_common.reference): losses and weights to the last bit (the same fp16 operations in the
    same order; measured), the global gradient norm within 1e-6 (the reference sums in fp32 in another
    order). Under 1F1B the same run is test_pipeline.py's clipping test."""
    cli = ["--steps", 3, "--optimizer", "sgd", "--loss-scale", "static:128", "--clip", 0.05, "--act-ckpt", "--delayed"]
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


def test_split_backward_schedules_or_their_refusal(tmp_path):
    """The torch each split-backward schedule needs (torch_compat.SCHEDULE_MIN_TORCH): on an older torch
    pipeline: zbv stops every rank in smp.init with UnsupportedFeatureError naming the torch that has it,
    before any collective (a refusal later let one rank leave while the other was still connecting its
    groups: "Connection reset by peer" instead of the refusal); on a newer one it trains as one process does (the six-layer model, SGD, pp 2)."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "pipeline": "zbv"}
    if not SPLIT_BACKWARD_REFUSED:
        _check(_run(tmp_path, "six", 2, options), "six", 4)
        return
    with pytest.raises(AssertionError) as failed:
        _run(tmp_path, "six", 2, options)
    logs = str(failed.value)
    assert logs.count("UnsupportedFeatureError: pipeline: zbv needs torch >= 2.13") == 2, logs[-3000:]
    assert "smp.init" in logs and "Connection reset" not in logs, logs[-3000:]
