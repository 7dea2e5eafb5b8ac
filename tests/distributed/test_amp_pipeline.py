"""smp.amp.GradScaler with pipeline parallelism (issue 12 item 4), against single-process PyTorch
with torch.amp.GradScaler on the same model, weights and batches.

The first stage never calls scaler.scale(loss) (its step body stops at model(...)); it must still
step, skip on overflow and update its scale exactly as the last stage does. fp32 model: multiplying
and dividing by a power-of-two scale is exact, so losses match within float rounding of the
microbatch average (1e-5 relative, the tolerance of the other pipeline tests)."""

import json

import pytest
import torch
import torch.nn.functional as F
from launch_util import ROOT, run_ranks
from mnist_amp_pp import Net, batch

SCRIPT = ROOT / "tests/distributed/scripts/mnist_amp_pp.py"


def _reference(steps, size, overflow_at, skip_at=-1):
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales = [], []
    for step in range(steps):
        data, target = batch(step, size, overflow_at)
        opt.zero_grad()
        # two microbatches: smp averages the microbatch losses
        halves = [(data[:size // 2], target[:size // 2]), (data[size // 2:], target[size // 2:])]
        mb_losses = [F.nll_loss(model(d), t) for d, t in halves]
        scaler.scale(sum(mb_losses) / 2).backward()
        losses.append(sum(x.item() for x in mb_losses) / 2)
        if step == skip_at:  # the distributed run's last stage overflowed alone: the whole step is skipped
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return losses, scales, model.state_dict()


@pytest.mark.parametrize("schedule", [{}, {"pipeline": "zero_bubble"}], ids=["1f1b", "zb_h1"])
def test_grad_scaler_pp2_matches_single_process_and_skips_overflow_on_every_stage(tmp_path, schedule):
    """Also under ZB-H1: the last stage's backward split into input- and weight-gradient steps must
    leave the same scaled gradients for the scaler to unscale, check and skip."""
    options = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, **schedule}
    results = run_ranks(SCRIPT, 2, args=["--steps", 5, "--overflow-at", 2, "--last-stage-inf-at", 3],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(options)}, out_dir=tmp_path, timeout=200)
    ref_losses, ref_scales, ref_state = _reference(5, 8, 2, skip_at=3)
    assert ref_scales == [65536.0, 65536.0, 32768.0, 16384.0, 16384.0]  # both overflow steps backed off
    for r in results:
        assert r["scales"] == ref_scales, r
        finite = [i for i, x in enumerate(ref_losses) if x == x and abs(x) != float("inf")]
        torch.testing.assert_close(torch.tensor([r["losses"][i] for i in finite]),
                                   torch.tensor([ref_losses[i] for i in finite]), rtol=1e-5, atol=0.0)
    assert sorted(r["pp_rank"] for r in results) == [0, 1]
    # the script asks for trace_device="cpu": carried out (the stages are traced with fake tensors, no
    # parameter is ever placed whole on a device), so nothing is said about it
    warned = {r["rank"]: r["trace_warnings"] for r in results}
    assert warned == {0: [], 1: []}, warned
    final = results[0]["final_state"] or results[1]["final_state"]
    for name, ref in ref_state.items():  # a stage that stepped through the overflow would differ here
        torch.testing.assert_close(torch.tensor(final[name]), ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_autocast_in_the_step_body_reaches_the_stages(tmp_path):
    """torch.autocast around model(...) in the step body: the stages' forwards (run by the schedule,
    outside the body) compute under the same autocast, as in one process. Reference: the same model
    and microbatches in one process under the same autocast; bf16 rounding makes it differ from fp32
    by ~1e-3, far above the 1e-5 the pipeline matches it to (activations cross stages widened to
    fp32, which is exact)."""
    import os

    from pp_autocast import data, net

    def reference(autocast):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = data()
        losses = []
        for _ in range(3):
            opt.zero_grad()
            total = 0.0
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = F.mse_loss(model(xm).float(), ym)
                (loss / 2).backward()
                total += loss.item() / 2
            opt.step()
            losses.append(total)
        return losses

    results = run_ranks(ROOT / "tests/distributed/scripts/pp_autocast.py", 2, out_dir=tmp_path,
                        env={"AUTOCAST": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    last = next(r for r in results if r["pp_rank"] == 1)
    assert last["dtypes"] == ["torch.bfloat16"]  # what model(...) returned in the body, as in one process
    bf16, fp32 = reference(True), reference(False)
    assert max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32)) > 1e-4  # the check can tell them apart
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(bf16), rtol=1e-5, atol=1e-6)
