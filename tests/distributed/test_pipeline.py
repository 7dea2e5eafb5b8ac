"""Pipeline parallelism (torch.distributed.pipelining under the smp API), CPU/gloo, compared with a
single-process plain-PyTorch run of the same model, initial weights and global batches.

Per-step losses must match within 1e-5 relative (fp32); final weights (gathered with
``model.state_dict()``) too, which checks gradients and the optimizer update of every stage.
"""

import json

import pytest
import torch
from launch_util import ROOT, run_ranks
from train_pp_common import reference

SCRIPT = ROOT / "tests/distributed/scripts/train_pp.py"
ERRORS = ROOT / "tests/distributed/scripts/train_pp_errors.py"
RTOL = 1e-5


def _run(tmp_path, model, nprocs, options, steps=2, optimizer="sgd"):
    return run_ranks(SCRIPT, nprocs, args=["--model", model, "--steps", steps, "--optimizer", optimizer],
                     env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=200)


def _check(results, model, microbatches, steps=2, per_rank_batch=8, optimizer="sgd"):
    ref_losses, ref_state = reference(model, steps, per_rank_batch * results[0]["dp_size"], microbatches, optimizer)
    for r in results:  # every rank returns the same values (broadcast from the last stage)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0.0)
        assert len(r["mb_losses"][0]) == microbatches
        assert r["partitioned"]
    if results[0]["final_state"] is not None:
        for name, ref in ref_state.items():
            torch.testing.assert_close(torch.tensor(results[0]["final_state"][name]), ref, rtol=RTOL, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
    if results[0]["eval_out"] is not None:  # forward-only step after training step 0, then training goes on
        from train_pp_common import build

        trained = build(model)
        trained.load_state_dict(reference(model, 1, per_rank_batch * results[0]["dp_size"], microbatches, optimizer)[1])
        for r in results:
            with torch.no_grad():
                expected = trained.eval()(torch.tensor(r["eval_in"]))
            torch.testing.assert_close(torch.tensor(r["eval_out"]), expected, rtol=RTOL, atol=1e-5)


def test_seed_tp2_pp2_convnet_4_processes(tmp_path):
    """shared/seeds/000: pp 2 x tp 2, 4 microbatches, fc1 marked with set_tensor_parallelism."""
    options = {"microbatches": 4, "pipeline_parallel_degree": 2, "placement_strategy": "cluster",
               "tensor_parallel_degree": 2, "ddp": True}
    results = _run(tmp_path, "net", 4, options)
    _check(results, "net", 4)
    assert all(r["outputs_shape"] == [8, 8] for r in results)  # model outputs usable on every rank
    by_stage = {r["pp_rank"]: r for r in results}
    assert by_stage[0]["local_names"] == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]
    assert by_stage[1]["local_names"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    # fc1 (256 x 32) is split over the 2 TP ranks of stage 1: 4 KiB weight + 264 floats of fc2 + biases
    assert by_stage[1]["local_bytes"] == 4 * (256 * 32 // 2 + 32 + 32 * 8 + 8)
    log0 = (tmp_path / "log0.txt").read_text()
    assert "Partition assignments" in log0 and "fc1 -> 1" in log0


def test_seed_manual_partition_simple_schedule(tmp_path):
    """shared/seeds/003: modules created inside smp.partition(0) / smp.partition(1), auto_partition off."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "auto_partition": False,
               "default_partition": 0, "pipeline": "simple"}
    results = _run(tmp_path, "manual", 2, options)
    _check(results, "manual", 4)
    assert results[1]["local_names"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_six_layers_auto_partition_active_microbatches(tmp_path):
    options = {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "active_microbatches": 1}
    results = _run(tmp_path, "six", 2, options)
    _check(results, "six", 4)
    assert [len(r["local_names"]) for r in results] == [6, 6]  # three Linear layers per stage


def test_gpt2_pp2_dp2_balanced_tied_embeddings(tmp_path):
    """GPT2LMHeadModel from its config: 2 stages whose parameter bytes differ by <= 10%; the tied
    wte/lm_head weight is held by both end stages and its gradient summed over them."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}
    results = _run(tmp_path, "gpt2", 4, options, steps=2)
    _check(results, "gpt2", 2, steps=2)
    by_stage = {r["pp_rank"]: r["local_bytes"] for r in results}
    assert abs(by_stage[0] - by_stage[1]) <= 0.1 * max(by_stage.values()), by_stage
    assert "Tied parameters held by several stages" in (tmp_path / "log0.txt").read_text()


@pytest.mark.parametrize("model", ["gptneo", "gptj"])
def test_gpt_neo_and_gptj_as_the_2022_templates_build_them_pp2(tmp_path, model):
    """GPT-Neo and GPT-J as the public 2022 smp templates run them: their configs keep use_cache=True,
    the step calls the model without use_cache=, parameters created under delayed initialisation
    (GPT-Neo: the embedding tied to the LM head across the two stages). Pipelined, each trains as
    the single process does: the cache is switched off before tracing, with a note (it failed to
    trace the cache object); GPT-J's first stage returns a non-contiguous activation, sent and
    received contiguous (gloo refused the traced strides' buffer)."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}
    results = run_ranks(SCRIPT, 2, args=["--model", model, "--steps", 2, "--delayed"],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=200)
    _check(results, model, 2, steps=2)
    assert "config.use_cache set to False" in (tmp_path / "log0.txt").read_text()


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_shard_optimizer_state_pp2_dp2(tmp_path, fp16):
    """shard_optimizer_state with pp 2 x dp 2 (Adam): each stage's optimizer state (with fp16: of the
    fp32 masters) is split between its 2 data-parallel ranks (ZeRO-1) and training matches
    single-process PyTorch (fp16: the hand-written fp16 recipe; the data-parallel average of fp16
    gradients rounds differently from one process's, hence the tolerance)."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "shard_optimizer_state": True,
               "fp16": fp16}
    if fp16:
        results = run_ranks(SCRIPT, 4, args=["--model", "six", "--steps", 3, "--optimizer", "adam", "--loss-scale",
                                             "static:128"], env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                            out_dir=tmp_path, timeout=200)
        ref_losses, _ = reference("six", 3, 16, 2, "adam", torch.float16, 128.0)
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=2e-3, atol=0.0)
    else:
        results = _run(tmp_path, "six", 4, options, steps=3, optimizer="adam")
        _check(results, "six", 2, steps=3, optimizer="adam")
    for stage in (0, 1):
        ranks = [r for r in results if r["pp_rank"] == stage]
        assert len(ranks) == 2 and ranks[0]["local_names"] == ranks[1]["local_names"]
        owned = [set(r["state_names"]) for r in ranks]
        assert owned[0] and owned[1] and not owned[0] & owned[1]  # each parameter's state on one rank
        assert owned[0] | owned[1] == set(ranks[0]["local_names"])


def test_boolean_values_crossing_stages(tmp_path):
    """A boolean mask made on the first stage and read on the second (train_pp_common.GatedNet), pp 2,
    1F1B, an evaluation step between training steps: losses, final weights and the evaluation output
    equal one process. The stage receiving the mask is a training stage: torch < 2.13 made its receive
    buffer require a gradient ("only Tensors of floating point dtype can require gradients") and wanted
    a gradient to send back for it ("has gradients None and is expecting to send gradients"):
    torch_compat.receive_integers. Mutation checks on torch 2.11 (measured; 2.12 fails as 2.11 did unguarded): without the guard every
    rank fails with the first error; with zeros not sent for the mask, with the second."""
    results = _run(tmp_path, "gated", 2, {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True})
    _check(results, "gated", 4)


@pytest.mark.parametrize("case,error,text", [
    ("untraceable", "UnsupportedFeatureError", r"profiling pass.*of Untraceable.*pipeline_parallel_degree: 1"),
    ("order", "SMPUsageError", r"module 'b' is placed on stage 0 but runs after 'a' on stage 1.*set_partition"),
    ("early_save", "SMPUsageError", r"partial checkpoint can be saved only after the first @smp.step call.*partial=False"),
    ("compiling", None, ""),  # not an error: the profiling pass runs in torch.export's compiling state
])
def test_unsplittable_models_fail_on_every_rank(tmp_path, case, error, text):
    import re

    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True,
               "auto_partition": case != "order", "default_partition": 0}
    results = run_ranks(ERRORS, 2, args=["--case", case], env={"SM_HP_MP_PARAMETERS": json.dumps(options)},
                        out_dir=tmp_path, timeout=120)
    for r in results:
        assert r["error"] == error, r
        assert re.search(text, r["message"], re.S), r["message"]


def test_other_inputs_get_their_own_stages_and_torch_clipping_is_global(tmp_path):
    """Traced with a keyword input (target) at the first step, then called without it in eval mode
    (Trainer.predict on rows without labels), on a batch of another size, and again; training goes on after.
    Every call equals one process; each new signature was traced once (3: train with target, eval without,
    eval on 6 rows), every stage holds the model's own parameters. Training clips with
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01): the norm over both stages, as one process
    (a per-stage norm gives other losses from step 2 on)."""
    import importlib.util

    script = ROOT / "tests/distributed/scripts/train_pp_signatures.py"
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}
    results = run_ranks(script, 2, env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=150)
    spec = importlib.util.spec_from_file_location("train_pp_signatures", script)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    torch.manual_seed(0)
    model = ref.WithTarget()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train, first, other = ref.data()

    def step(x, target):
        optimizer.zero_grad()
        loss = model(x, target=target)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        return float(loss.detach()), float(norm)

    steps = [step(x, t) for x, t in train[:3]]
    with torch.no_grad():
        predicted = [model.eval()(x) for x in (first, other, first)]
    model.train()
    steps.append(step(*train[3]))
    assert steps[0][1] > 0.1  # 0.01 clips
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor([s[0] for s in steps]), rtol=RTOL, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor([s[1] for s in steps]), rtol=RTOL, atol=1e-6)
        for got, expected in zip(r["predicted"], predicted):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=RTOL, atol=1e-6)
        assert r["shared"], r
    assert results[0]["signatures"] == 3, results[0]


@pytest.mark.parametrize("model,nprocs,extra,cli", [
    ("six", 2, {}, []),
    # the tied wte / lm_head weight is in both end stages' files; created under delayed initialisation, the
    # resumed job loads its stage's values into a model that has none yet (recorded, replayed with the stage)
    ("gpt2", 2, {}, ["--delayed"]),
    ("net", 4, {"tensor_parallel_degree": 2, "placement_strategy": "cluster"}, []),  # TP shards inside stage 1
    ("six", 4, {"shard_optimizer_state": True}, []),  # optimizer state shards, one file per rdp rank
    ("six", 2, {"fp16": True}, ["--loss-scale", "dynamic:1024"]),  # fp32 masters and the loss scaler's state
])
def test_partial_checkpoint_resume_is_exact(tmp_path, model, nprocs, extra, cli):
    """save_checkpoint(partial=True) after step 2 of 4 (Adam), then a new job resumes before its first
    step (the model is not cut into stages yet) and trains steps 3-4: the same losses, bitwise."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, **extra}
    ckpt = tmp_path / "ckpt"
    env = {"SM_HP_MP_PARAMETERS": json.dumps(options)}
    common = ["--model", model, "--optimizer", "adam", "--ckpt-dir", ckpt, *cli]
    full = run_ranks(SCRIPT, nprocs, args=[*common, "--steps", 4, "--save-at", 2], env=env,
                     out_dir=tmp_path / "full", timeout=200)
    resumed = run_ranks(SCRIPT, nprocs, args=[*common, "--steps", 2, "--first-step", 2, "--resume"], env=env,
                        out_dir=tmp_path / "resumed", timeout=200)
    assert (ckpt / "newest").read_text().strip() == "step2"
    files = sorted(p.name for p in (ckpt / "step2_partial").iterdir())
    stages = [f"stage_pp{p}_tp{t}.pt" for p in range(2) for t in range(options.get("tensor_parallel_degree", 1))]
    if options.get("shard_optimizer_state"):
        stages += [f"optimizer_pp{p}_tp0_rdp{d}.pt" for p in range(2) for d in range(2)]
    assert set(stages) <= set(files) and "smp_manifest.json" in files
    for r in resumed:
        assert r["losses"] == full[0]["losses"][2:]  # exact, not approximate
        assert r["scales"] == full[0]["scales"][2:]
        assert r["roundtrip"] is True  # smp.save/smp.load of model.local_state_dict() with pp > 1
    from smp_adapter.runtime.engines.pipeline.torch_compat import SCHEDULE_MIN_TORCH, older_than

    if model == "six" and not extra and not older_than(*SCHEDULE_MIN_TORCH["zbv"]):
        # saved under 1F1B (stages [0, 1]), resumed under zbv (4 stages, [0, 1, 1, 0]): the stage files
        # do not fit, so the layout-independent pieces are read (model, Adam state, step)
        env = {"SM_HP_MP_PARAMETERS": json.dumps({**options, "pipeline": "zbv"})}
        other = run_ranks(SCRIPT, nprocs, args=[*common, "--steps", 2, "--first-step", 2, "--resume"], env=env,
                          out_dir=tmp_path / "zbv", timeout=200)
        for r in other:  # fp32 sums of the same microbatch gradients in the same order: measured equal
            assert r["losses"] == full[0]["losses"][2:]


@pytest.mark.parametrize("precision,dtype,loss_scale,schedule", [("fp16", torch.float16, 128.0, "interleaved"),
                                                                   ("bf16", torch.bfloat16, 1.0, "zbv")])
def test_mixed_precision_matches_a_hand_written_reference(tmp_path, precision, dtype, loss_scale, schedule):
    """fp16 / bf16 with pp 2: the model runs in half precision, Adam updates fp32 master weights, the
    loss is scaled (fp16). Compared with the same recipe written out in one process (train_pp_common):
    equal to the last bit, the same operations in the same order."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, precision: True, "pipeline": schedule}
    cli = ["--loss-scale", f"static:{loss_scale}"] if precision == "fp16" else []
    args = ["--model", "six", "--steps", 3, "--optimizer", "adam", *cli]
    env = {"SM_HP_MP_PARAMETERS": json.dumps(options)}
    from smp_adapter.runtime.engines.pipeline.torch_compat import SCHEDULE_MIN_TORCH, older_than

    if schedule in SCHEDULE_MIN_TORCH and older_than(*SCHEDULE_MIN_TORCH[schedule]):
        # an older torch (the support matrix's lowest point, a GPU image's 2.11): refused by name on every rank
        with pytest.raises(AssertionError, match=f"pipeline: {schedule} needs torch >= 2.13") as refused:
            run_ranks(SCRIPT, 2, args=args, env=env, out_dir=tmp_path, timeout=200)
        assert str(refused.value).count("UnsupportedFeatureError") >= 2, "every rank says why"
        return
    results = run_ranks(SCRIPT, 2, args=args, env=env, out_dir=tmp_path, timeout=200)
    ref_losses, ref_state = reference("six", 3, 8, 2, "adam", dtype, loss_scale)
    for r in results:
        assert r["param_dtypes"] == [str(dtype)]
        assert r["scales"] == [loss_scale] * 3 and r["overflows"] == [False] * 3
        assert r["losses"] == ref_losses
    for name, ref in ref_state.items():
        torch.testing.assert_close(torch.tensor(results[0]["final_state"][name]), ref.float(), rtol=0.0, atol=0.0,
                                   msg=lambda m: f"{name}: {m}")
    if schedule == "zbv":  # 4 stages in a V, split input/weight backward: still the same bf16 operations in order
        assert "Partition assignments (auto, 4 stages" in (tmp_path / "log0.txt").read_text()


def test_fp16_dynamic_loss_scale_skips_overflowing_steps(tmp_path):
    """Dynamic loss scaling starting far too high: every overflowing step is skipped on every rank
    (weights unchanged) and halves the scale, until steps go through."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "fp16": True}
    results = run_ranks(SCRIPT, 2, args=["--model", "six", "--steps", 40, "--optimizer", "adam",
                                         "--loss-scale", f"dynamic:{2.0**40}"],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=200)
    for r in results:
        assert r["overflows"][0] and not r["overflows"][-1]
        assert r["overflows"] == results[0]["overflows"]  # the same decision on every stage
        before = [r["checksums"][0]] + r["checksums"]  # (the first step's "before" is its own value if skipped)
        for i, overflow in enumerate(r["overflows"]):
            if overflow:
                assert r["scales"][i + 1] == r["scales"][i] / 2 if i + 1 < len(r["scales"]) else True
                assert i == 0 or r["checksums"][i] == r["checksums"][i - 1]
            else:
                assert i == 0 or r["checksums"][i] != r["checksums"][i - 1]
        assert r["scales"][0] == 2.0**40 and min(r["scales"]) < 2.0**20


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_clip_master_grads_clips_the_global_norm_over_all_stages(tmp_path, fp16):
    """optimizer.clip_master_grads(max_norm) with pp 2: the norm is taken over both stages' gradients
    (fp16: the fp32 masters' unscaled gradients), as torch.nn.utils.clip_grad_norm_ in one process.
    max_norm is small enough that every step is clipped."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "fp16": fp16}
    # fp16: with every layer activation-checkpointed too (recomputed in the backward, same numbers)
    cli = ["--loss-scale", "static:128", "--act-ckpt"] if fp16 else []
    results = run_ranks(SCRIPT, 2, args=["--model", "six", "--steps", 3, "--optimizer", "sgd", "--clip", 0.05, *cli],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=200)
    dtype = torch.float16 if fp16 else None
    ref_losses, ref_state = reference("six", 3, 8, 2, "sgd", dtype, 128.0 if fp16 else 1.0, clip=0.05)
    unclipped, _ = reference("six", 3, 8, 2, "sgd", dtype, 128.0 if fp16 else 1.0)
    assert ref_losses[2] != unclipped[2]  # clipping changed the run
    tol = dict(rtol=2e-3, atol=0.0) if fp16 else dict(rtol=1e-5, atol=0.0)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **tol)
    for name, ref in ref_state.items():
        torch.testing.assert_close(torch.tensor(results[0]["final_state"][name]), ref.float(),
                                   rtol=tol["rtol"], atol=1e-3 if fp16 else 1e-6, msg=lambda m: f"{name}: {m}")
    if fp16:
        assert "Activation checkpointing in the stage(s) of pipeline rank 1: layers.3, layers.4, layers.5" in \
            (tmp_path / "log1.txt").read_text()
