"""The Hugging Face Trainer's SageMaker model-parallel path, driven through smp-adapter on GPU ranks
(tests/distributed/test_recipes.py runs it on CUDA-on-CPU ranks)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_trainer_recipe_runs_through_launch(tmp_path):
    cmd = [sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch", "--gpu",
           "--recipe", str(ROOT / "recipes/hf_trainer/gpt2_trainer.yaml"), "--hp", f"run_dir={tmp_path}",
           "--hp", "steps=6", "--job-dir", str(tmp_path / "job")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "final training loss" in result.stdout + result.stderr
