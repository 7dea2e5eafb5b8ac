"""CUDA-only checks (NCCL, fp16 loss scaling). CI has no GPU: every test here skips cleanly.
Run them on a GPU machine with `bash scripts/test.sh tests/gpu`."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = Path(__file__).resolve().parent


def test_fp16_dynamic_loss_scale_trains_on_one_gpu(tmp_path):
    sys.path.insert(0, str(HERE.parent / "distributed"))
    from launch_util import run_ranks

    options = {"ddp": True, "fp16": True, "microbatches": 2}
    results = run_ranks(HERE / "fp16_script.py", 1, env={"SM_HP_MP_PARAMETERS": json.dumps(options),
                                                          "DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0"},
                        out_dir=tmp_path)
    losses = results[0]["losses"]
    assert results[0]["dtype"] == "torch.float16"
    assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL data parallel")
def test_nccl_sharded_data_parallel_two_gpus(tmp_path):
    sys.path.insert(0, str(HERE.parent / "distributed"))
    from launch_util import ROOT, run_ranks

    options = {"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0}
    results = run_ranks(ROOT / "tests/distributed/scripts/train_vit.py", 2,
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options), "DS_ACCELERATOR": "cuda",
                             "CUDA_VISIBLE_DEVICES": "0,1"}, out_dir=tmp_path)
    assert results[0]["zero_stage"] == 3 and results[0]["losses"] == results[1]["losses"]
