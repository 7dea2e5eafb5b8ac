"""What happens when things go wrong: a rank raising mid-training, a rank killed mid-save."""

import json
import time

import pytest
from launch_util import ROOT, run_ranks
from test_data_parallel import SDP_EXACT

SCRIPT = ROOT / "tests/distributed/scripts/train_vit.py"
OPTIONS = {"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}


def test_rank_raising_ends_the_job_quickly_with_its_error(tmp_path):
    start = time.time()
    with pytest.raises(AssertionError) as failure:
        run_ranks(SCRIPT, 2, args=["--steps", 6, "--raise-at-step", 2],
                  env={"SM_HP_MP_PARAMETERS": json.dumps(OPTIONS), "SMP_ADAPTER_TIMEOUT": "30"},
                  out_dir=tmp_path, timeout=120)
    elapsed = time.time() - start
    report = str(failure.value)
    assert "injected failure in rank 1 at step 2" in report
    assert "did not finish" not in report  # both ranks ended by themselves: no hang
    assert elapsed < 60, f"job took {elapsed:.0f}s to end after a rank failed"


def test_kill_during_save_keeps_previous_checkpoint_and_resume_is_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = {"SM_HP_MP_PARAMETERS": json.dumps(OPTIONS)}
    with pytest.raises(AssertionError):  # rank 1 is SIGKILLed during the step-4 save
        run_ranks(SCRIPT, 2, args=["--steps", 6, "--save-at", 4, "--die-in-save", "--ckpt-dir", ckpt,
                                   "--optimizer", "adam", "--lr", 1e-3],
                  env=env, out_dir=tmp_path / "killed", timeout=120)
    assert (ckpt / "newest").read_text().strip() == "step2"
    assert not (ckpt / "step4_partial").exists()  # the half-written one never got its final name
    assert (ckpt / "step2_partial" / "smp_manifest.json").exists()
    # resume from what is there, and compare with an uninterrupted run
    resumed = run_ranks(SCRIPT, 2, args=["--steps", 4, "--first-step", 2, "--resume", "--ckpt-dir", ckpt,
                                         "--optimizer", "adam", "--lr", 1e-3],
                        env=env, out_dir=tmp_path / "resumed")
    full = run_ranks(SCRIPT, 2, args=["--steps", 6, "--optimizer", "adam", "--lr", 1e-3],
                     env=env, out_dir=tmp_path / "full")
    assert resumed[0]["losses"] == full[0]["losses"][2:]
