"""The Hugging Face Trainer's SageMaker model-parallel path, driven through smp-adapter (GPU only:
transformers builds torch.device("cuda", smp.local_rank()) on that path)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.xfail(strict=True, reason="transformers 5.x: on its SageMaker-MP path Trainer delays optimizer creation, "
                   "then skips it because the model is wrapped, and fails at LambdaLR(None) (seen on CPU ranks, "
                   "2026-11-22); strict, so a fixed transformers shows up here")
def test_trainer_recipe_runs_through_launch(tmp_path):
    cmd = [sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch", "--gpu",
           "--recipe", str(ROOT / "recipes/hf_trainer/gpt2_trainer.yaml"), "--hp", f"run_dir={tmp_path}",
           "--hp", "steps=6", "--job-dir", str(tmp_path / "job")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "final training loss" in result.stdout + result.stderr
