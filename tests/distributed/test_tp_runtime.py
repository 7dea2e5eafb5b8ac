"""Tensor parallelism through the whole runtime (smp.init -> DistributedModel -> DistributedOptimizer),
with the seed scripts' styles, compared with plain single-process PyTorch on the global batch."""

import json

import pytest
import torch
from launch_util import ROOT, run_ranks
from tp_common import Net, reference, tiny_gpt2

SCRIPT = ROOT / "tests/distributed/scripts/train_tp.py"


def _initial_state(model_name):
    torch.manual_seed(42)  # what dp rank 0 builds; every other rank is synced to it
    return (Net() if model_name == "convnet" else tiny_gpt2()).state_dict()


def _check(results, model_name, per_rank_batch=4, steps=3, clip=None):
    r0 = results[0]
    ref_losses, ref_state = reference(model_name, steps, per_rank_batch * r0["readers"], _initial_state(model_name),
                                      clip)
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, ref in ref_state.items():
        torch.testing.assert_close(torch.tensor(r0["final_state"][name]), ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tp", [2, 4])
def test_seed_tp_only_convnet_plain_backward(tmp_path, tp):
    options = {"pipeline_parallel_degree": 1, "placement_strategy": "cluster", "tensor_parallel_degree": tp,
               "ddp": True}
    results = run_ranks(SCRIPT, tp, env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path)
    split = results[0]["split"]
    assert "fc1.weight" in split and "fc2.weight" in split  # both nn.Linear were distributed
    assert split["fc1.weight"][0] * split["fc1.weight"][1] * tp == 256 * 32  # 1/tp of the weight per rank
    _check(results, "convnet")


@pytest.mark.parametrize("prescaled", [False, True])
def test_gpt2_tp2_dp2_matches_and_reloads_with_from_pretrained(tmp_path, prescaled):
    from transformers import GPT2LMHeadModel

    options = {"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled, "microbatches": 2}
    hf_dir = tmp_path / "hf"
    results = run_ranks(SCRIPT, 4, args=["--model", "gpt2", "--save-hf", hf_dir],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path)
    assert any("c_attn" in n for n in results[0]["split"])
    _check(results, "gpt2")
    reloaded = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    _, ref_state = reference("gpt2", 3, 4 * results[0]["readers"], _initial_state("gpt2"))
    expected = tiny_gpt2().eval()
    expected.load_state_dict(ref_state)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ["hpz", "mics"])
def test_sdp_with_tensor_parallelism_tp2_sdp2_of_rdp4(tmp_path, engine):
    """smp v1.15's layout (tp 4, sdp 4 of rdp 8) in small: tp 2 x rdp 4 on 8 processes, sdp 2 < rdp 4.
    hpz: ZeRO-3 with hpZ groups of 2. DeepSpeed's hpZ group must be smp's sharding group, a chunk of
    the rank's RDP group: DeepSpeed's own choice (consecutive global ranks) pairs the two TP ranks,
    which hold different shards. mics (the default): FSDP2 groups of 2 inside each TP rank's RDP group,
    the TP-split Megatron weights sharded again inside them. Trained with SGD against the unsplit model
    on the global batch (prescaled_batch, which sdp with tp requires: the 4 RDP ranks read 4 batches);
    the final state is gathered over both (model.state_dict())."""
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig

    options = {"tensor_parallel_degree": 2, "ddp": True, "sharded_data_parallel_degree": 2, "prescaled_batch": True,
               "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
    # mics: the script clips with torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) (the Trainer's way),
    # which must take the norm over the sharding group and a TP-split weight's shards over the TP group
    clip = ["--clip", 0.05, "--clip-with", "torch"] if engine == "mics" else []
    results = run_ranks(SCRIPT, 8, args=["--model", "gpt2", "--steps", 2, *clip], out_dir=tmp_path,
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options), "SMP_ADAPTER_SDP_ENGINE": engine})
    grid = ParallelDims.from_config(SMPConfig.from_dict(options), 8, engine).grid
    for r in results:
        if engine == "hpz":
            assert r["hpz_group"] == next(list(g) for g in grid.sdp_groups(2) if r["rank"] in g)
            assert set(r["hpz_group"]) <= set(grid.rdp_group(r["rank"]))
        else:
            assert r["hpz_group"] is None
    _check(results, "gpt2", steps=2, clip=0.05 if clip else None)


@pytest.mark.parametrize("tp,extra", [(2, {}), (2, {"pipeline_parallel_degree": 2, "microbatches": 2}),
                                     (2, {"shard_optimizer_state": True, "microbatches": 2}),
                                     (1, {"sharded_data_parallel_degree": 2})],
                         ids=["tp2", "tp2-pp2", "tp2-dp2-zero1", "sdp2"])
def test_clip_master_grads_with_tensor_parallelism(tmp_path, tp, extra):
    """clip_master_grads with TP: the norm counts each split weight's shards once over the TP group and
    replicated parameters once, so every TP rank clips by the same factor (otherwise replicated
    parameters drift apart) and training matches torch's clip_grad_norm_ in one process. ZeRO 0 and
    pp > 1 clip in smp-adapter; ZeRO 1 (GPT-2, TP 2 x DP 2) in DeepSpeed's optimizer, given our mpu.
    Every other step clips with torch.nn.utils.clip_grad_norm_(model.parameters()) instead (a plain script's
    and the Trainer's clip, runtime/clipping.py routes it), the same global norm; sdp 2 (ZeRO-3, gradients
    in DeepSpeed's partitions) with it too: its norm from the local partitions, DeepSpeed clipping in the step."""
    options = {"placement_strategy": "cluster", "tensor_parallel_degree": tp, "ddp": True, **extra}
    nprocs = max(2, tp * extra.get("pipeline_parallel_degree", 1))
    if "microbatches" in extra:  # the pipeline script: loss from @smp.step, the seed's TP+PP net
        from launch_util import ROOT as root
        from train_pp_common import reference as pp_reference

        results = run_ranks(root / "tests/distributed/scripts/train_pp.py", nprocs,
                            args=["--model", "net", "--steps", 3, "--clip", 0.05, "--clip-with", "both"],
                            env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path)
        global_batch = 8 * results[0]["dp_size"]  # each TP rank reads its own 8 samples (no prescaled_batch)
        ref_losses, ref_state = pp_reference("net", 3, global_batch, 2, clip=0.05)
        unclipped, _ = pp_reference("net", 3, global_batch, 2)
        assert ref_losses[2] != unclipped[2]
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, ref in ref_state.items():
            torch.testing.assert_close(torch.tensor(results[0]["final_state"][name]), ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
        return
    model = "gpt2" if extra.get("shard_optimizer_state") else "convnet"
    nprocs = 4 if model == "gpt2" else nprocs
    # sdp: torch's clip at every step (clip_master_grads would set DeepSpeed's clip for the steps after it too)
    clip_with = "torch" if "sharded_data_parallel_degree" in extra else "both"
    results = run_ranks(SCRIPT, nprocs, args=["--model", model, "--clip", 0.05, "--clip-with", clip_with],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path)
    _check(results, model, clip=0.05)
    # what torch's clip returned: the norm DeepSpeed's ZeRO step computes itself (ZeRO-1 here: read from its
    # partitions at the call; it was nan), the same on every rank
    for r in results:
        assert r["torch_clip_norms"] and r["torch_clip_norms"] == results[0]["torch_clip_norms"], r["torch_clip_norms"]
        for returned, step_norm in r["torch_clip_norms"]:
            assert returned > 0.05, r["torch_clip_norms"]  # finite, and this clip did clip
            if step_norm is not None:
                assert abs(returned - step_norm) <= 1e-5 * step_norm, r["torch_clip_norms"]
