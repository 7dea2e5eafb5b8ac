"""recipes/hf_trainer/run_glue.py: a GLUE-style fine-tune (HfArgumentParser, TrainingArguments, Trainer,
CSV data, do_train / do_eval / do_predict) on transformers' own SageMaker model-parallel path, run
with the environment and arguments `smp-adapter launch --cpu --no-mp-parameters` gives its ranks
(launch_util.run_as_launched), on tiny BERT- and RoBERTa-style models made here (glue_inputs.py).

pp 2 (2 microbatches, BERT, dropout off, ``--max_grad_norm 0.01``, which clips every step): the logged
losses, the evaluation metrics (12 rows: a last, smaller batch) and the logits predicted on the test rows
without their labels (as transformers' run_glue predicts) equal the same Trainer run without smp on one process
within 1e-5, and so do the gradient norms it logs: the Trainer's clip_grad_norm_ (through accelerate) clips by
the norm over both stages (each stage's own norm is smaller than the whole model's), and the
evaluation and prediction calls run stages traced for their own inputs (runtime/engines/pipeline/signature.py).
The checkpoint at the last step holds the optimizer saved through accelerate's wrapper. tp 2 and sdp 2
(RoBERTa): finite, falling losses; at tp 2 rank 0 says nothing was split. Runs on transformers 5.x
(the default stack) and 4.57 (the support matrix's transformers-4.57 point, scripts/test.sh), whose
Trainer wraps smp's optimizer in accelerate's AcceleratedOptimizer (compat/hf_transformers.py).

The SageMaker-MP GLUE script's flow (scripts/glue_sagemaker_mp.py: Hugging Face datasets, GLUE's columns,
test labels -1 removed before predict, padding per batch, so batch shapes change from step to step and the
Trainer's collator hands smp.step a BatchEncoding) at pp 2 equals one process the same way."""

import json
import math
import subprocess
import sys

import pytest
from glue_inputs import make_glue_inputs, make_inputs
from launch_util import ROOT, run_as_launched

SCRIPT = ROOT / "recipes" / "hf_trainer" / "run_glue.py"
SAGEMAKER_MP_SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "glue_sagemaker_mp.py"
STEPS = 16


def _args(inputs: dict, out) -> list[str]:
    return ["--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
            "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]),
            "--do_train", "--do_eval", "--do_predict", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "8", "--max_steps", str(STEPS), "--learning_rate", "2e-3",
            "--logging_steps", "1", "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS),
            "--max_grad_norm", "0.01", "--seed", "1", "--output_dir", str(out)]


def _launched(tmp_path, name: str, options: dict, inputs: dict) -> tuple[str, list[float]]:
    out = tmp_path / name
    output = run_as_launched("--cpu", "--no-mp-parameters", "--options", json.dumps(options), "--job-dir",
                             str(tmp_path / f"job-{name}"), str(SCRIPT), *_args(inputs, out), cwd=tmp_path)
    losses = json.loads((out / "train_losses.json").read_text())
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] > 0
    assert len((out / "test_predictions.csv").read_text().splitlines()) == 9
    return output, losses


def _results(out) -> tuple[list[float], dict, list]:
    return (json.loads((out / "train_losses.json").read_text()), json.loads((out / "eval_results.json").read_text()),
            json.loads((out / "test_logits.json").read_text()))


def _max_difference(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def test_pp2_equals_one_process_and_saves_through_accelerate(tmp_path):
    inputs = make_inputs(tmp_path / "data", "bert")
    single = tmp_path / "single"
    proc = subprocess.run([sys.executable, str(SCRIPT), *_args(inputs, single), "--save_strategy", "no"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, ref_metrics, ref_logits = _results(single)
    _launched(tmp_path, "pp2", {"pipeline_parallel_degree": 2, "microbatches": 2}, inputs)
    losses, metrics, logits = _results(tmp_path / "pp2")
    assert _max_difference(losses, reference) < 1e-5, (losses, reference)
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    for key in ("eval_loss", "eval_accuracy"):
        assert abs(metrics[key] - ref_metrics[key]) < 1e-5, (key, metrics, ref_metrics)
    assert _max_difference(logits, ref_logits) < 1e-5, (logits, ref_logits)
    # the norm the Trainer logs (transformers rounds the loss to 4 digits, not the norm): over both stages
    norms, ref_norms = (json.loads((out / "train_grad_norms.json").read_text()) for out in (tmp_path / "pp2", single))
    assert len(norms) == STEPS and min(ref_norms) > 0.01, ref_norms  # 0.01 clips every step
    assert _max_difference(norms, ref_norms) < 1e-5 * max(ref_norms), (norms, ref_norms)
    saved = {p.name for p in (tmp_path / "pp2" / f"checkpoint-{STEPS}").iterdir()}
    assert {"optimizer.pt_0_0", "optimizer.pt_1_0", "model.safetensors"} <= saved, saved


@pytest.mark.parametrize("options", [{"tensor_parallel_degree": 2, "ddp": True},
                                     {"sharded_data_parallel_degree": 2, "ddp": True}], ids=["tp2", "sdp2"])
def test_tp2_and_sdp2_train(tmp_path, options):
    inputs = make_inputs(tmp_path / "data", "roberta")
    output, losses = _launched(tmp_path, "run", options, inputs)
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    if "tensor_parallel_degree" in options:
        assert output.count("nothing in RobertaForSequenceClassification was split") == 1, output[-3000:]


def _trainer_state(out) -> tuple[list[float], list[float]]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e], [e["grad_norm"] for e in history if "grad_norm" in e]


def test_sagemaker_mp_glue_script_pp2_padding_per_batch_equals_one_process(tmp_path):
    inputs = make_glue_inputs(tmp_path / "data", "bert")
    args = ["--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
            "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]), "--do_train",
            "--do_eval", "--do_predict", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
            "--max_steps", "8", "--learning_rate", "2e-3", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--max_grad_norm", "0.01", "--seed", "1", "--pad_to_max_length", "False"]
    single = tmp_path / "single"
    proc = subprocess.run([sys.executable, str(SAGEMAKER_MP_SCRIPT), *args, "--output_dir", str(single)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    pp2 = tmp_path / "pp2"
    run_as_launched("--cpu", "--no-mp-parameters", "--options",
                    json.dumps({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}), "--job-dir",
                    str(tmp_path / "job"), str(SAGEMAKER_MP_SCRIPT), *args, "--output_dir", str(pp2), cwd=tmp_path)
    (losses, norms), (ref_losses, ref_norms) = _trainer_state(pp2), _trainer_state(single)
    assert len(losses) == 8 and _max_difference(losses, ref_losses) < 1e-5, (losses, ref_losses)
    assert min(ref_norms) > 0.01 and _max_difference(norms, ref_norms) < 1e-5 * max(ref_norms), (norms, ref_norms)
    metrics, ref_metrics = (json.loads((out / "eval_results.json").read_text()) for out in (pp2, single))
    assert metrics["eval_samples"] == 12
    for key in ("eval_loss", "eval_accuracy"):
        assert abs(metrics[key] - ref_metrics[key]) < 1e-5, (key, metrics, ref_metrics)
    logits, ref_logits = (json.loads((out / "test_logits.json").read_text()) for out in (pp2, single))
    assert len(logits) == 8 and _max_difference(logits, ref_logits) < 1e-5, (logits, ref_logits)
