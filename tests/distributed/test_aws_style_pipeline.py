"""The BERT- and MNIST-style pipeline scripts of tests/fixtures/aws_style (smp.init() with the job's
options, hard-coded CUDA placement) run unchanged as `smp-adapter launch --cpu --options ...` runs
them: with the environment and arguments launch gives its ranks, the ranks forked from the test
process's job server (aws_style.py says why; the pipeline recipes run through the whole launcher).

BERT: pp 2 with smp.optimizers.FusedLAMB against one process training the same model on the same
global batches with the same optimizer (1e-5 relative: the pipeline changes only where the
microbatch sums are taken). MNIST: pp 2 with torch.cuda.amp.autocast and smp.amp.GradScaler; the
first stage never scales a loss, yet both stages step and keep one scale (the exact GradScaler
comparison is tests/distributed/test_amp_pipeline.py); checked for learning."""

import json
import math

import pytest

from aws_style import FIXTURES, bert_reference, make_bert, make_mnist, run_forked_ok


def _options(options):
    return ("--options", json.dumps(options))


def test_bert_style_pp2_fused_lamb(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = make_bert(tmp_path / "data")
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "partitions": 2}
    results, _ = run_forked_ok(FIXTURES / "bert/pretrain.py", 2, {"results_file": run_dir / "results.json"}, run_dir,
                               channels={"train": data}, extra=_options(options))
    reference = bert_reference(data, data_ranks=1, microbatches=2)
    for step, (got, want) in enumerate(zip(results["losses"], reference)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} != {want} (reference)"
    assert results["losses"][-1] < results["losses"][0]


@pytest.mark.parametrize("schedule", [{}, {"pipeline": "zero_bubble"}], ids=["1f1b", "zb_h1"])
def test_mnist_style_pp2_autocast_grad_scaler(tmp_path, schedule):
    """Also under ZB-H1 (zero_bubble at v = 1, the one schedule past 1F1B that keeps smp.partition's
    meaning: one stage per pipeline rank), whose last stage splits its backward into input- and
    weight-gradient steps while the script's GradScaler unscales and steps every stage."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = {"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True, "partitions": 2,
               "auto_partition": False, "default_partition": 0, **schedule}
    results, output = run_forked_ok(FIXTURES / "mnist/train_mnist.py", 2, {"results-file": run_dir / "results.json"},
                                    run_dir, channels={"train": make_mnist(tmp_path / "data")}, extra=_options(options))
    losses = results["epoch_losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert results["correct"] > 0.5 * results["seen"], results  # 10 classes: chance is 10 %
    assert results["scales"] and all(s >= 1.0 for s in results["scales"])
    assert (run_dir / "job/model/pt_mnist_checkpoint.pt_0_0_0").exists() or \
        any((run_dir / "job/model").glob("pt_mnist_checkpoint.pt*")), sorted((run_dir / "job").rglob("*"))
