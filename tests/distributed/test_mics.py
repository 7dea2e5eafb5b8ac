"""sharded_data_parallel_degree < rdp on the MiCS engine (runtime/engines/mics: torch FSDP2 hybrid
sharding), each job a real multi-process CPU/gloo run of the seed-style ViT script (seed 002)
compared with plain single-process PyTorch on the same model, initial weights and global batches.

Tolerance: 1e-5 relative on losses (fp32), as tests/distributed/test_data_parallel.py. SGD makes a
wrongly scaled gradient reduction visible (a summed instead of averaged gradient: gloo's summing
reduce, pytorch#162338, changes the second loss by ~1e-2); Adam would hide it.
Memory: each rank's parameter, gradient and Adam-moment bytes are read from the tensors it holds
(train_vit.py: the local shards' numel x element size), against the whole model's.
"""

import json

import pytest
import torch
from common import reference_losses, tiny_vit
from launch_util import ROOT, run_ranks

SCRIPT = ROOT / "tests/distributed/scripts/train_vit.py"
LR = {"sgd": 0.1, "adam": 1e-3}


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(tiny_vit().state_dict(), path)
    return str(path)


def _run(out, options, nprocs, *args, env=None):
    return run_ranks(SCRIPT, nprocs, args=[str(a) for a in args], out_dir=out, timeout=240,
                     env={"SM_HP_MP_PARAMETERS": json.dumps({"ddp": True, "sdp_gradient_clipping": 0.0, **options}),
                          **(env or {})})


def _matches(results, optimizer, init_weights, steps=4, per_rank_batch=4):
    r0 = results[0]
    ref, _ = reference_losses(steps, per_rank_batch * r0["dp_size"], LR[optimizer], optimizer, init_weights)
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for r in results:  # every rank agrees on the global loss
        assert r["losses"] == pytest.approx(r0["losses"], rel=1e-6)


@pytest.mark.parametrize("sdp, nprocs, microbatches, optimizer, delayed, compiled", [
    (2, 4, 1, "sgd", False, False), (2, 4, 2, "adam", False, False), (2, 6, 2, "sgd", True, False),
    (2, 6, 1, "adam", True, False), (2, 4, 2, "adam", False, True)],
    ids=["sdp2_rdp4_mb1", "sdp2_rdp4_mb2_adam", "sdp2_rdp6_mb2_delayed", "sdp2_rdp6_mb1_adam_delayed",
         "sdp2_rdp4_mb2_adam_compiled"])
def test_mics_matches_one_process(tmp_path, init_weights, sdp, nprocs, microbatches, optimizer, delayed, compiled):
    """Losses equal one process; each rank holds 1/sdp of the parameters, gradients and Adam moments
    (within 5 %: the shards of tensors whose first dimension does not divide by sdp differ by a row).
    delayed: no weights loaded after wrapping, so the run starts from what smp.model_creation's
    delayed initialisation made, which must be tiny_vit()'s eager weights. Microbatches 2: with
    activation checkpointing on every encoder layer. compiled: SMP_ADAPTER_COMPILE=blocks, each encoder
    layer compiled before FSDP2 shards it (aot_eager: the traced graph run eagerly, seconds instead of
    inductor's tens of seconds per rank on a shared 2-core machine; the same aten ops, same tolerance)."""
    args = ["--optimizer", optimizer, "--lr", LR[optimizer]] + ([] if delayed else ["--init-weights", init_weights])
    if microbatches == 2:  # smp.set_activation_checkpointing on each encoder layer (a unit of its own)
        args.append("--checkpoint-activations")
    results = _run(tmp_path, {"sharded_data_parallel_degree": sdp, "microbatches": microbatches}, nprocs, *args,
                   env={"SMP_ADAPTER_COMPILE": "blocks:aot_eager"} if compiled else None)
    assert (results[0]["dynamo_graphs"] > 0) == compiled
    assert results[0]["zero_stage"] == "mics"  # DeepSpeed's engine is not there: model.engine is None
    _matches(results, optimizer, None if delayed else init_weights)
    whole = results[0]["total_param_bytes"]
    for r in results:
        assert r["param_bytes"] == pytest.approx(whole / sdp, rel=0.05), r["param_bytes"]
        assert r["grad_bytes"] == pytest.approx(whole / sdp, rel=0.05), r["grad_bytes"]
        if optimizer == "adam":
            assert r["adam_moment_bytes"] == pytest.approx(2 * whole / sdp, rel=0.05), r["adam_moment_bytes"]


def _ledger_steps(folder, rank):
    lines = (folder / f"rank{rank}.jsonl").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if rec.get("step") is not None]


@pytest.mark.parametrize("engine", ["mics", "hpz"])
def test_ledger_shows_where_each_engine_communicates(tmp_path, init_weights, engine):
    """sdp 2 of rdp 6, microbatches 2. MiCS: all-gathers and reduce-scatters only inside groups of 2
    ("sdp"), and per optimizer step one all-reduce across the groups ("replicate") of each rank's
    gradient shard: its bytes are a shard's fp32 gradient bytes (1/sdp of the model's, padded to the
    largest shard of the group). hpZ: the
    gradients are reduce-scattered over all 6 replicas ("rdp") and nothing crosses as an all-reduce."""
    ledger = tmp_path / "ledger"
    results = _run(tmp_path / "out", {"sharded_data_parallel_degree": 2, "microbatches": 2,
                                      "sdp_param_persistence_threshold": 0}, 6,
                   "--optimizer", "sgd", "--lr", LR["sgd"], "--init-weights", init_weights, "--steps", 2,
                   env={"SMP_ADAPTER_COMM_LEDGER": str(ledger), "SMP_ADAPTER_SDP_ENGINE": engine})
    _matches(results, "sgd", init_weights, steps=2)
    for rank, r in enumerate(results):
        steps = _ledger_steps(ledger, rank)
        assert len(steps) == 2
        for step in steps:
            ops = {}
            for op in step["ops"]:
                key = (op["group"], op["op"])
                ops[key] = [a + b for a, b in zip(ops.get(key, [0, 0]), [op["calls"], op["bytes"]])]
            if engine == "mics":
                assert {g for g, o in ops if o in ("all_gather", "reduce_scatter")} == {"sdp"}, ops
                # FSDP2 pads each shard to the group's largest (torch.chunk rows): the first rank of a group's
                crossing = ops[("replicate", "all_reduce")][1]
                assert crossing == max(x["grad_bytes"] for x in results) >= r["grad_bytes"], (ops, r["grad_bytes"])
                assert crossing == pytest.approx(r["total_param_bytes"] / 2, rel=0.05)
                # across all replicas: only the script's own all-reduce of its 4-byte loss
                assert {k: v for k, v in ops.items() if k[0] in ("rdp", "dp", "world")} == {("rdp", "all_reduce"): [1, 4]}
            else:
                assert ops[("rdp", "reduce_scatter")][1] > 0 and ("replicate", "all_reduce") not in ops, ops
                assert {g for g, o in ops if o == "all_gather"} <= {"sdp", "rdp"}, ops


def test_partial_checkpoint_resume_is_exact(tmp_path, init_weights):
    """Save a partial checkpoint after step 2 of 4 (Adam: moments sharded), resume from it in a new job:
    the resumed steps' losses equal the uninterrupted run's; the resume verifies the files' digests."""
    options = {"sharded_data_parallel_degree": 2}
    ckpt = tmp_path / "ckpt"
    common = ["--optimizer", "adam", "--lr", LR["adam"], "--init-weights", init_weights, "--ckpt-dir", ckpt]
    full = _run(tmp_path / "full", options, 4, *common, "--steps", 4, "--save-at", 2)
    resumed = _run(tmp_path / "resumed", options, 4, *common, "--steps", 2, "--first-step", 2, "--resume")
    assert (ckpt / "step2_partial" / "smp_manifest.json").exists()
    assert resumed[0]["losses"] == full[0]["losses"][2:]


def half_reference(init_weights, nprocs: int, steps: int, lr: float, microbatches=1, per_rank_batch=4,
                   dtype=torch.bfloat16, loss_scale=1.0):
    """The MiCS bf16/fp16 recipe written out in one process: fp32 master weights; each data-parallel rank's
    forward and backward in ``dtype`` on each microbatch of its rows (inputs cast, as FSDP2's policy casts
    them; the loss divided by the microbatches and, in fp32, multiplied by the static ``loss_scale``); each
    microbatch's gradients to fp32, summed, averaged over the ranks and divided by the scale; SGD on the fp32
    masters. The loss: each rank's mean over its microbatches in ``dtype`` (StepOutput.reduce_mean),
    averaged over the ranks.
    ``init_weights`` None: tiny_vit()'s own initial weights (what delayed initialisation must give)."""
    from common import global_batch

    master = tiny_vit()
    if init_weights:
        master.load_state_dict(torch.load(init_weights, weights_only=True))
    loss_fn, losses = torch.nn.CrossEntropyLoss(), []
    for step in range(steps):
        images, labels = global_batch(step, per_rank_batch * nprocs)
        grads = [torch.zeros_like(p) for p in master.parameters()]
        step_losses = []
        size = per_rank_batch // microbatches
        for rank in range(nprocs):
            rank_losses = []
            for mb in range(microbatches):
                model = tiny_vit()
                model.load_state_dict(master.state_dict())
                model.to(dtype)
                rows = slice(rank * per_rank_batch + mb * size, rank * per_rank_batch + (mb + 1) * size)
                loss = loss_fn(model(images[rows].to(dtype))["logits"], labels[rows])
                ((loss / microbatches).float() * loss_scale).backward()
                rank_losses.append(loss.detach())
                for g, p in zip(grads, model.parameters()):
                    g += p.grad.float()
            step_losses.append(torch.stack(rank_losses).mean().item())  # reduce_mean(): in bf16, as smp's
        with torch.no_grad():
            for p, g in zip(master.parameters(), grads):
                p -= lr * (g / nprocs / loss_scale)
        losses.append(sum(step_losses) / len(step_losses))
    return losses


@pytest.mark.parametrize("nprocs, microbatches, delayed", [(4, 1, False), (6, 2, True)],
                         ids=["rdp4_mb1", "rdp6_mb2_delayed"])
def test_mics_bf16_matches_the_recipe_in_one_process(tmp_path, init_weights, nprocs, microbatches, delayed):
    """bf16 on MiCS (sdp 2 of rdp 4 or 6, SGD): FSDP2's mixed precision against the same recipe in one process
    (half_reference). Tolerance 1e-5 relative, as fp32: the recipe's bf16 arithmetic is the same on both
    sides; only the fp32 order in which the ranks' gradients are summed differs."""
    weights = None if delayed else init_weights
    results = _run(tmp_path, {"sharded_data_parallel_degree": 2, "bf16": True, "microbatches": microbatches}, nprocs,
                   "--optimizer", "sgd", "--lr", LR["sgd"], *([] if delayed else ["--init-weights", init_weights]))
    ref = half_reference(weights, nprocs, 4, LR["sgd"], microbatches)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    fp32, _ = reference_losses(4, 4 * nprocs, LR["sgd"], "sgd", weights)
    assert torch.tensor(results[0]["losses"]).sub(torch.tensor(fp32)).abs().max() > 1e-5  # it did run in bf16


@pytest.mark.parametrize("how", ["sdp_gradient_clipping", "torch"])
def test_sdp_gradient_clipping_clips_by_the_global_norm(tmp_path, init_weights, how):
    """sdp_gradient_clipping 0.05 (smp's default is 1.0), or the script's torch.nn.utils.clip_grad_norm_(
    model.parameters(), 0.05) under the default sdp_gradient_clipping (torch's own clip of the FSDP2 DTensor
    gradients takes the norm over the mesh; the step's 1.0 then changes nothing): the MiCS job against one
    process that clips with torch.nn.utils.clip_grad_norm_ before each SGD step (the gradients' norm here is
    ~1: every step clips)."""
    from common import global_batch

    options = {"sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.05 if how != "torch" else 1.0}
    results = _run(tmp_path, options, 4, "--optimizer", "sgd", "--lr", LR["sgd"], "--init-weights", init_weights,
                   *(["--torch-clip", 0.05] if how == "torch" else []))
    model = tiny_vit()
    model.load_state_dict(torch.load(init_weights, weights_only=True))
    opt, losses, norms = torch.optim.SGD(model.parameters(), lr=LR["sgd"]), [], []
    for step in range(4):
        images, labels = global_batch(step, 16)
        opt.zero_grad()
        loss = torch.nn.CrossEntropyLoss()(model(images)["logits"], labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        losses.append(loss.item())
    assert min(norms) > 0.05  # the reference did clip
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_mics_fp16_static_loss_scale_matches_the_recipe_in_one_process(tmp_path, init_weights):
    """fp16 on MiCS (sdp 2 of rdp 4, SGD, microbatches 2, static loss scale 128): FSDP2's fp16 compute and
    gathers, fp32 shards, the loss scaled and the gradient shards unscaled before the update, against the same
    recipe in one process (half_reference). Tolerance as the bf16 test's: the same fp16 arithmetic on both
    sides (the scale and the averages are powers of two), only the fp32 order of the ranks' sums differs."""
    results = _run(tmp_path, {"sharded_data_parallel_degree": 2, "fp16": True, "microbatches": 2}, 4,
                   "--optimizer", "sgd", "--lr", LR["sgd"], "--init-weights", init_weights, "--loss-scale", "static:128")
    ref = half_reference(init_weights, 4, 4, LR["sgd"], 2, dtype=torch.float16, loss_scale=128.0)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    # (a loss left unscaled, or gradients left scaled, would be 128 x off from the second loss on)
    fp32, _ = reference_losses(4, 16, LR["sgd"], "sgd", init_weights)
    assert torch.tensor(results[0]["losses"]).sub(torch.tensor(fp32)).abs().max() > 1e-5  # it did run in fp16
    assert all(r["scales"] == [128.0] * 4 and not any(r["overflows"]) for r in results)


def test_mics_fp16_dynamic_loss_scale_skips_overflowing_steps_and_resumes_its_scale(tmp_path, init_weights):
    """Dynamic loss scaling starting at 2**40 (sdp 2 of rdp 4): every step whose fp16 gradients overflow on some
    rank is skipped on every rank (the shards unchanged) and halves the scale, until steps go through and
    train; a partial checkpoint saved after them resumes with the scale the run had reached."""
    options = {"sharded_data_parallel_degree": 2, "fp16": True}
    args = ["--optimizer", "adam", "--lr", LR["adam"], "--init-weights", init_weights, "--loss-scale", f"dynamic:{2.0**40}"]
    runs = _run(tmp_path / "a", options, 4, *args, "--steps", 30, "--save-at", 30, "--ckpt-dir", tmp_path / "ckpt")
    for r in runs:
        assert r["overflows"] == runs[0]["overflows"]  # the same decision on every rank
        assert r["overflows"][0] and not r["overflows"][-1]
        for i, overflow in enumerate(r["overflows"]):
            if i + 1 < len(r["scales"]):
                assert r["scales"][i + 1] == (r["scales"][i] / 2 if overflow else r["scales"][i])
            if i:
                assert (r["checksums"][i] == r["checksums"][i - 1]) == overflow  # skipped: the shards unchanged
    assert runs[0]["scales"][0] == 2.0**40 and runs[0]["scale_after"] < 2.0**30
    resumed = _run(tmp_path / "b", options, 4, *args, "--steps", 1, "--first-step", 30, "--resume",
                   "--ckpt-dir", tmp_path / "ckpt")
    assert resumed[0]["scales"] == [runs[0]["scale_after"]]
