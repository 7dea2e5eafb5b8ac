"""The GPT template-style script (tests/fixtures/aws_style/gpt/train.py: smp options built by the
script, hard-coded CUDA placement, FusedLayerNorm, smp's seq_layers walk, ZeRO internals, partial
checkpoints) runs unchanged as `smp-adapter launch --cpu` runs it, against a single-process reference:
the sdp 2 case through the whole launcher, the others with the environment and arguments launch gives
its ranks, the ranks forked from the test process's job server (aws_style.py says why).

Tolerance 1e-5 relative on fp32 losses: the runs differ from one process only in the order of the
data-parallel sums and the tensor-parallel partial matmuls (observed 1.2e-7). Delayed parameter
initialisation draws the initial weights through transformers' ZeRO-3 path (a different random
sequence), and bf16 rounds: those runs are checked for finite, decreasing losses instead."""

import math

import pytest

from aws_style import FIXTURES, gpt_reference, make_tokens, run_forked_ok, run_ok

SCRIPT = FIXTURES / "gpt/train.py"
RTOL = 1e-5


def _run(tmp_path, nprocs, args, name="run", through_launcher=False):
    run_dir = tmp_path / name
    run_dir.mkdir()
    data = make_tokens(tmp_path / "data")
    run = run_ok if through_launcher else run_forked_ok
    results, output = run(SCRIPT, nprocs, {**args, "results_file": run_dir / "results.json"}, run_dir,
                          channels={"train": data})
    return results, output, data


def _assert_matches(losses, reference):
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} != {want} (reference)"


def _assert_learns(losses):
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.02, losses  # ln(64) = 4.16 at start; the patterns are learnable


def test_gpt2_sharded_data_parallel_hf_layers(tmp_path):
    """use_distributed_transformer 0, sdp 2 (ZeRO-3): ds_tensor read before the optimizer exists,
    fp32_partitioned_groups_flat read through smp.DistributedOptimizer."""
    args = {"sharded_data_parallel_degree": 2, "use_distributed_transformer": 0}
    results, output, data = _run(tmp_path, 2, args, through_launcher=True)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=2))
    assert results["sharded_params"] == results["zero_flat"] == results["num_params"] // 2
    # norms of the ds_tensor shards summed over optimizer.ds_param_shard_group: the whole model's norm
    assert abs(results["shard_norm"] - gpt_reference.initial_norm) <= 1e-5 * gpt_reference.initial_norm
    assert "CUDA on CPU ranks" in output  # the launcher said once that the shim is on
    assert output.count("CUDA on CPU ranks") == 1


def test_gpt2_mics_sdp2_of_rdp4_reads_the_zero_names(tmp_path):
    """sdp 2 of 4 ranks: smp v1's MiCS (the MiCS engine on FSDP2), the template unchanged: its ZeRO-3 reads
    (p.ds_shape to count the model, p.ds_tensor norms summed over optimizer.ds_param_shard_group,
    optimizer.fp32_partitioned_groups_flat, fp16_groups' shapes) answered from the FSDP2 shards."""
    args = {"sharded_data_parallel_degree": 2, "use_distributed_transformer": 0}
    results, output, data = _run(tmp_path, 4, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=4))
    # each rank's shards: half the model, up to a row per tensor whose first dimension is odd
    assert results["sharded_params"] == results["zero_flat"]
    assert abs(results["sharded_params"] - results["num_params"] / 2) <= 0.05 * results["num_params"] / 2
    assert abs(results["shard_norm"] - gpt_reference.initial_norm) <= 1e-5 * gpt_reference.initial_norm


def test_falcon_sharded_data_parallel(tmp_path):
    """The Falcon sibling's setup: sdp 2 (ZeRO-3) over Hugging Face's Falcon layers (which have no
    tensor-parallel mapping), against the single-process reference. (Under delayed initialisation the
    weights are drawn on gathered shards, so only learning could be checked: the GPT-NeoX test does.)"""
    args = {"model_type": "falcon", "sharded_data_parallel_degree": 2, "use_distributed_transformer": 0}
    results, _, data = _run(tmp_path, 2, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=2))
    assert results["sharded_params"] == results["num_params"] // 2


def test_flan_t5_sharded_data_parallel_checkpointing(tmp_path):
    """The Flan-T5 sibling's setup: an encoder-decoder (AutoModelForSeq2SeqLM, labels = input_ids)
    under sdp 2 (ZeRO-3) with its encoder and decoder blocks activation-checkpointed, and the
    template's "Grad norm" log line (optimizer._global_grad_norm, DeepSpeed's) against the
    single-process reference's norm before clipping."""
    args = {"model_type": "flan_t5", "sharded_data_parallel_degree": 2, "use_distributed_transformer": 0,
            "activation_checkpointing": 1, "num_layers": 2}
    results, _, data = _run(tmp_path, 2, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=2))
    assert results["sharded_params"] == results["num_params"] // 2 and results["layers"] == 2
    assert abs(results["grad_norm"] - gpt_reference.last_grad_norm) <= 1e-4 * gpt_reference.last_grad_norm


def test_gpt2_distributed_transformer_tp2_sdp2_checkpointing(tmp_path):
    """use_distributed_transformer 1: transformer.seq_layers with grouped activation checkpointing;
    tp 2 x sdp 2 with prescaled_batch (4 processes, 2 data ranks)."""
    args = {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": 1,
            "use_distributed_transformer": 1, "activation_checkpointing": 1, "activation_strategy": "group_2"}
    results, _, data = _run(tmp_path, 4, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=2))
    assert results["layers"] == 4


def test_gptj_tp2_sdp2_delayed_init(tmp_path):
    """The GPT-J case that crashed (LM head already ZeRO-partitioned when split for TP)."""
    args = {"model_type": "gptj", "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2,
            "prescaled_batch": 1, "delayed_param": 1, "use_distributed_transformer": 1, "max_steps": 6}
    results, _, _ = _run(tmp_path, 4, args)
    _assert_learns(results["losses"])


def test_gpt_neox_sdp_delayed_init_bf16_sublayer_checkpointing(tmp_path):
    args = {"model_type": "gpt_neox", "sharded_data_parallel_degree": 2, "delayed_param": 1, "bf16": 1,
            "use_distributed_transformer": 1, "activation_checkpointing": 1, "checkpoint_sublayers": 1,
            "max_steps": 6}
    results, _, _ = _run(tmp_path, 2, args)
    _assert_learns(results["losses"])


def test_save_checkpoint_then_resume_with_load_partial(tmp_path, tp=2):
    """Steps 0-1 then a partial checkpoint; a new job resumes it (--load_partial) for steps 2-3:
    the losses are the uninterrupted run's. tp 2 x sdp 2: TP shards and ZeRO-3 partitions in one
    checkpoint (sdp alone resumes in test_data_parallel.py and test_reshard_checkpoint.py)."""
    ckpt = tmp_path / "checkpoints"
    base = {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": tp, "prescaled_batch": int(tp > 1),
            "use_distributed_transformer": 1, "checkpoint_dir": ckpt}
    first, _, data = _run(tmp_path, 2 * tp, {**base, "max_steps": 2, "checkpoint_freq": 2}, name="first")
    assert (ckpt / "newest").read_text().strip().startswith("total_steps2")
    resumed, _, _ = _run(tmp_path, 2 * tp, {**base, "max_steps": 4, "load_partial": 1}, name="resumed")
    assert resumed["start_step"] == 2
    _assert_matches(first["losses"] + resumed["losses"], gpt_reference(base, data, data_ranks=2))


def test_gpt_simple_style_pp2_tp2_dp2_shard_optimizer_state_manual_partition(tmp_path):
    """train_gpt_simple-style 3D run: pp 2 x tp 2 x dp 2 (8 processes) with the templates' default
    prescaled_batch, shard_optimizer_state (each stage's state split over its 2 replicas),
    set_partition over seq_layers (ln_f / lm_head left on default_partition 0 join the last stage),
    activation checkpointing of each layer (set_activation_checkpointing(seq_layers,
    strategy="each")), Hugging Face layers split for TP inside the traced stages, the loss from
    labels= on the last stage, and, as the templates' data pipelines do, empty placeholder batches
    on the second stage (only the first stage's inputs feed the model). Losses and the clipping
    norm (optimizer._global_grad_norm, over all stages and TP ranks) against one process on the same
    global batches: a wrong gradient through the traced TP collectives moves the norm long before
    Adam lets it move the losses. 3 steps: the norm is compared at the last."""
    args = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": 1,
            "shard_optimizer_state": 1, "microbatches": 2, "manual_partition": 1, "use_distributed_transformer": 1,
            "activation_checkpointing": 1, "activation_strategy": "each", "max_steps": 3}
    results, output, data = _run(tmp_path, 8, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=2))  # prescaled: TP ranks share rows
    assert abs(results["grad_norm"] - gpt_reference.last_grad_norm) <= RTOL * gpt_reference.last_grad_norm
    assert "transformer.ln_f -> 1" in output
    # each stage's traced layers are checkpointed again (torch.export would inline the checkpoint)
    assert "Activation checkpointing in the stage(s) of pipeline rank 0: transformer.h.0, transformer.h.1" in output
    assert "Activation checkpointing in the stage(s) of pipeline rank 1: transformer.h.2, transformer.h.3" in output


def test_gpt_simple_style_pp2_tp2_fp16_auto_partition(tmp_path):
    """fp16 (dynamic loss scale) with pp 2 x tp 2 and smp's default prescaled_batch false: the TP
    ranks exchange their rows inside the traced stages. Rounding: checked for learning."""
    args = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2, "fp16": 1,
            "use_distributed_transformer": 1, "max_steps": 8}
    results, _, _ = _run(tmp_path, 4, args)
    _assert_learns(results["losses"])


@pytest.mark.parametrize("model_type,tp", [("gpt2", 2), ("llama", 2)], ids=["gpt2-pp2xtp2", "llama-pp2xtp2"])
def test_delayed_init_pipeline_matches_one_process_and_saves_a_loadable_model(tmp_path, model_type, tp):
    """delayed_parameter_initialization at pp 2 x tp 2 (GPT-2 in smp's distributed-transformer
    layout, Llama's Hugging Face layers split in place): no rank ever holds the whole model (each replays
    its stage's creation from the record, the tensor-parallel split included), and the losses are
    those of one process training the same model built without delayed initialisation, from the
    first step's on (which is the initial weights' loss). The full checkpoint saved from the
    pipeline (every stage's weights) loads with from_pretrained and computes what the reference
    model computes after the same steps."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    args = {"model_type": model_type, "pipeline_parallel_degree": 2, "tensor_parallel_degree": tp,
            "microbatches": 2, "delayed_param": 1, "use_distributed_transformer": int(model_type == "gpt2"),
            "max_steps": 3, "save_final_full_model": 1, "model_dir": model_dir}
    results, output, data = _run(tmp_path, 2 * tp, args)
    _assert_matches(results["losses"], gpt_reference(args, data, data_ranks=tp))
    hf_dir = tmp_path / "hf"
    reference = gpt_reference.final_model.eval()
    reference.config.save_pretrained(hf_dir)
    (hf_dir / "pytorch_model.bin").write_bytes((model_dir / "fullmodel.pt").read_bytes())
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_mics_distributed_transformer_delayed_init_bf16_saves_and_resumes(tmp_path):
    """The GPT-2 SDP template at its notebook's settings on MiCS (sdp 2 of 4 ranks): use_distributed_transformer
    1 (seq_layers walked on the FSDP2-wrapped blocks), delayed initialisation, bf16, activation checkpointing;
    a partial checkpoint at step 2, a new job resumes it with --load_partial and trains on."""
    ckpt = tmp_path / "checkpoints"
    base = {"sharded_data_parallel_degree": 2, "use_distributed_transformer": 1, "delayed_param": 1, "bf16": 1,
            "activation_checkpointing": 1, "checkpoint_dir": ckpt}
    first, _, _ = _run(tmp_path, 4, {**base, "max_steps": 3, "checkpoint_freq": 2}, name="first")
    assert first["layers"] == 4
    assert (ckpt / "newest").read_text().strip().startswith("total_steps2")
    resumed, _, _ = _run(tmp_path, 4, {**base, "max_steps": 5, "load_partial": 1}, name="resumed")
    assert resumed["start_step"] == 2
    _assert_learns(first["losses"] + resumed["losses"])


def test_gpt_neox_mics_distributed_transformer_delayed_init_bf16_saves_and_resumes(tmp_path):
    """The GPT-NeoX template's notebook layout on MiCS: sdp 2 of 4 ranks, use_distributed_transformer 1,
    delayed initialisation, bf16, sublayer checkpointing. A job saved at step 3 and resumed with
    --load_partial gives the uninterrupted job's losses for steps 3-5 (the same bf16 operations in the same
    order: exact)."""
    ckpt = tmp_path / "checkpoints"
    base = {"model_type": "gpt_neox", "sharded_data_parallel_degree": 2, "delayed_param": 1, "bf16": 1,
            "use_distributed_transformer": 1, "activation_checkpointing": 1, "checkpoint_sublayers": 1,
            "checkpoint_dir": ckpt}
    whole, _, _ = _run(tmp_path, 4, {**base, "max_steps": 6}, name="whole")
    assert whole["layers"] == 4
    _assert_learns(whole["losses"])
    _run(tmp_path, 4, {**base, "max_steps": 3, "checkpoint_freq": 3}, name="saving")
    resumed, _, _ = _run(tmp_path, 4, {**base, "max_steps": 6, "load_partial": 1}, name="resumed")
    assert resumed["losses"] == whole["losses"][3:]


def test_gptj_mics_tp2_sdp2_of_8_ranks_delayed_init_bf16_resumes_exactly(tmp_path):
    """The GPT-J template's notebook layout (tp 2 x sdp 2) with one more replica: 8 ranks, rdp 4, so MiCS over
    each TP rank's RDP group; use_distributed_transformer 1, delayed initialisation, bf16. A job saved at step 3
    and resumed with --load_partial gives the uninterrupted job's losses for steps 3-5 (the same bf16
    operations in the same order: exact)."""
    ckpt = tmp_path / "checkpoints"
    base = {"model_type": "gptj", "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2,
            "prescaled_batch": 1, "delayed_param": 1, "use_distributed_transformer": 1, "bf16": 1,
            "checkpoint_dir": ckpt}
    whole, output, _ = _run(tmp_path, 8, {**base, "max_steps": 6}, name="whole")
    assert "rdp 4, sdp 2, MiCS" in output
    _assert_learns(whole["losses"])
    _run(tmp_path, 8, {**base, "max_steps": 3, "checkpoint_freq": 3}, name="saving")
    resumed, _, _ = _run(tmp_path, 8, {**base, "max_steps": 6, "load_partial": 1}, name="resumed")
    assert resumed["losses"] == whole["losses"][3:]
