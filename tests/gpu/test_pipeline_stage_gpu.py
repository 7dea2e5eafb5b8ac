"""A pipeline rank's GPU memory (issue 40's GPU check): after the cut, what CUDA's allocator holds is
the rank's 1/p of the model, not the whole model; with delayed initialisation the whole model is
never on the GPU, not even for a moment. Each case runs tests/gpu/pipeline_stage_script.py in its
own process (a fresh allocator): a 16 x 4096^2 fp32 MLP, 1 GiB of parameters, 64 MiB a weight.

Reference: torch.cuda.memory_allocated (the allocator's count of live blocks), against the model's
parameter bytes / p. Bounds: 2 % over 1/p for the kept stage (its biases and the allocator's
512-byte rounding are far less); the peak of a delayed run adds at most two weights (the random
draw's scratch while recording on the GPU, and one replayed tensor before it lands in place)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WEIGHT = 4096 * 4096 * 4


def _stage(pp: int, stage: int, delayed: int, build_on: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "adapter"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "pipeline_stage_script.py"), "--pp", str(pp), "--stage", str(stage),
                           "--delayed", str(delayed), "--build-on", build_on], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    return result


@pytest.mark.parametrize("build_on", ["device", "host"])
@pytest.mark.parametrize("pp,stage", [(2, 0), (2, 1), (4, 3)])
def test_delayed_stage_holds_its_share_and_the_model_never_whole(pp, stage, build_on):
    r = _stage(pp, stage, 1, build_on)
    share = r["model_bytes"] / pp
    assert r["values_equal"] and r["other_stages_meta"] and r["gradients_on_device"], r
    assert r["allocated_after_creation"] <= WEIGHT, r  # nothing of the model (one scratch draw at most)
    assert r["allocated_after_keep_stage"] <= 1.02 * share, r
    assert r["allocated_after_keep_stage"] >= 0.98 * share, r  # the stage is there, on this GPU
    assert r["peak_allocated"] <= share + 2 * WEIGHT, r


@pytest.mark.parametrize("pp,stage", [(2, 1), (4, 0)])
def test_undelayed_stage_frees_the_other_stages(pp, stage):
    r = _stage(pp, stage, 0, "device")
    share = r["model_bytes"] / pp
    assert r["values_equal"] and r["other_stages_meta"] and r["gradients_on_device"], r
    assert r["allocated_after_creation"] >= r["model_bytes"], r  # built whole, as without delayed init
    assert r["allocated_after_keep_stage"] <= 1.02 * share, r
