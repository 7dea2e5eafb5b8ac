"""The 2022 AWS GPT templates' way (tests/fixtures/aws_style/gpt2022/train.py and its fp16/ helpers,
which import NVIDIA apex's amp_C and apex.multi_tensor_apply and torch._six unconditionally) and the
BERT example's apex use (tests/fixtures/aws_style/bert/pretrain.py: apex imported before smp) run on
CPU ranks as `smp-adapter launch --cpu` runs them, with no apex installed: the launched ranks import
smp-adapter's apex fallback (smp_adapter/compat/apex_fallback). BERT through the whole launcher; the GPT
runs with the environment and arguments launch gives its ranks (its apex shim on PYTHONPATH
included), the ranks forked from the test process's job server (aws_style.py says why).

* GPT, tp 2 x dp 2, fp32 (DeepSpeed has no fp16 on CPU at pp = 1): GPT2Block registered with
  DistributedTransformerLayer through smp's own hooks, so the blocks are split in place; the losses
  equal one process training the unregistered Hugging Face model (1e-5 relative, as
  test_aws_style_gpt.py). The helpers' per-tensor gradient norms (apex's multi_tensor_l2norm through
  the fallback) equal float64 sums within 1e-5 on every rank; the full save goes through the per-block
  translators and loads strictly into the Hugging Face model.
* GPT, pp 2 x tp 2, fp16 (the pipeline engine's fp16 runs on CPU): the helpers' overflow check
  (multi_tensor_scale's flag, agreed over the ranks) says "overflow" at exactly the steps the
  engine skipped (the dynamic scale starts at 2**20, so the first steps overflow), and it learns.
* BERT, pp 1 x dp 2: the example's post-accumulation averaging (amp.master_params, apex_C.unflatten,
  amp_C.multi_tensor_scale around an all-reduce) on gradients smp has already averaged changes
  nothing: the losses equal the single-process reference."""

import json
import math

from aws_style import FIXTURES, bert_reference, gpt_reference, make_bert, make_tokens, run_forked_ok, run_ok

SCRIPT = FIXTURES / "gpt2022/train.py"
RTOL = 1e-5  # fp32: only the order of the data-parallel sums and TP partial matmuls differs (test_aws_style_gpt.py)


def _run(tmp_path, nprocs, args):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = make_tokens(tmp_path / "data")
    results, output = run_forked_ok(SCRIPT, nprocs, {**args, "results_file": run_dir / "results.json"}, run_dir,
                                    channels={"train": data})
    return results, output, data, run_dir


def test_gpt_2022_style_tp2_dp2_registered_blocks_and_fp16_helpers(tmp_path):
    args = {"tensor_parallel_degree": 2, "prescaled_batch": 1, "max_steps": 4, "save_full": 1}
    results, output, data, run_dir = _run(tmp_path, 4, args)
    reference = gpt_reference(args, data, data_ranks=2)  # prescaled: the 2 TP ranks share rows
    assert len(results["losses"]) == len(reference)
    for step, (got, want) in enumerate(zip(results["losses"], reference)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} != {want} (reference)"
    # float32 sums of squares against float64 over these small tensors: well under 1e-5 relative
    assert all(count == 4 and worst < 1e-5 for count, worst in results["norm_checks"]), results["norm_checks"]
    assert results["helper_overflow"] == results["engine_overflow"] == [False] * 4
    assert results["switches"] == {"_match_weights": False, "fast_mode": False, "checkpoint_attentions": True}
    # the registered blocks are split (not left whole): each block's attention and MLP are TP units
    assert {f"transformer.h.{i}.{unit}" for i in range(4) for unit in ("attn", "mlp")} <= set(results["distributed"])
    assert (run_dir / "job" / "model" / "hf_model.pt").exists()


def test_gpt_2022_style_pp2_tp2_fp16_overflow_check_agrees_with_the_engine(tmp_path):
    # init scale 2**20: the first steps' fp16 gradients overflow (skipped, scale halved), the later ones train
    args = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2, "fp16": 1,
            "max_steps": 8, "init_loss_scale_log2": 20}
    results, _, _, _ = _run(tmp_path, 4, args)
    assert results["helper_overflow"] == results["engine_overflow"], results
    assert any(results["engine_overflow"]) and not all(results["engine_overflow"]), results  # both kinds seen
    losses = results["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(count > 0 for count, _ in results["norm_checks"])  # every rank's helpers ran on its gradients


def test_bert_style_apex_post_accumulation_averaging_dp2(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = make_bert(tmp_path / "data")
    options = {"microbatches": 2, "ddp": True}
    results, _ = run_ok(FIXTURES / "bert/pretrain.py", 2,
                        {"results_file": run_dir / "results.json", "allreduce_post_accumulation": 1}, run_dir,
                        channels={"train": data}, extra=("--options", json.dumps(options)))
    reference = bert_reference(data, data_ranks=2, microbatches=options["microbatches"])
    for step, (got, want) in enumerate(zip(results["losses"], reference)):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} != {want} (reference)"
