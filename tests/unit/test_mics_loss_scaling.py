"""The MiCS engine's fp16 loss scaling (runtime/engines/mics/loss_scaling.py) in one process: the loss
scaled in fp32, gradients divided by the scale once per step, an overflow skipping the step (gradients
dropped) and lowering the scale by DeepSpeed's rules, a clean window growing it again."""

import math

import pytest
import torch
from smp_adapter.runtime.engines.mics.loss_scaling import ShardLossScaler
from smp_adapter.translate.deepspeed import DEFAULT_DYNAMIC_LOSS_ARGS, LossScaleArgs


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    """DeepSpeed's scaler asks its communication layer for the rank only to log an overflow; one process here
    has no process group (the distributed tests, tests/distributed/test_mics.py, run the real one)."""
    import deepspeed.runtime.fp16.loss_scaler as ds_scaler

    monkeypatch.setattr(ds_scaler.dist, "get_rank", lambda *a, **k: 0)


def _params(*grads):
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, dtype=torch.float32)
    return params


def test_static_scale_scales_the_loss_in_fp32_and_unscales_each_gradient_once_per_step():
    scaler = ShardLossScaler(LossScaleArgs(static_loss_scale=128.0), torch.device("cpu"))
    loss = torch.tensor(1000.0, dtype=torch.float16)
    scaled = scaler.scale(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 128000.0  # beyond fp16's range: kept in fp32
    params = _params([256.0, -128.0], [64.0])
    grads = [p.grad for p in params]
    assert scaler.unscale(grads) and scaler.unscale(grads)  # a clip, then the step: divided once
    assert params[0].grad.tolist() == [2.0, -1.0] and params[1].grad.tolist() == [0.5]
    scaler.finish_step(params)
    assert not scaler.overflow and scaler.loss_scale == 128.0 and params[0].grad is not None


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_an_overflow_skips_the_step_drops_the_gradients_and_halves_a_dynamic_scale(bad):
    args = LossScaleArgs(static_loss_scale=None, dynamic_loss_scale=True,
                         **{**DEFAULT_DYNAMIC_LOSS_ARGS, "init_scale": 2.0**10, "scale_window": 2})
    scaler = ShardLossScaler(args, torch.device("cpu"))
    params = _params([1.0, bad], [3.0])
    assert not scaler.unscale([p.grad for p in params]) and scaler.overflow
    assert params[1].grad.tolist() == [3.0]  # nothing divided on an overflowing step
    scaler.finish_step(params)
    assert all(p.grad is None for p in params) and scaler.loss_scale == 2.0**9
    # DeepSpeed's window: the scale grows by scale_factor once scale_window clean steps follow the first clean
    # one after the overflow (3 steps for a window of 2), not before
    for _ in range(3):
        assert scaler.loss_scale == 2.0**9
        params = _params([2.0**9])
        assert scaler.unscale([p.grad for p in params]) and params[0].grad.tolist() == [1.0]
        scaler.finish_step(params)
    assert not scaler.overflow and scaler.loss_scale == 2.0**10


def test_hysteresis_keeps_the_scale_for_its_first_overflows():
    args = LossScaleArgs(static_loss_scale=None, dynamic_loss_scale=True,
                         **{**DEFAULT_DYNAMIC_LOSS_ARGS, "init_scale": 2.0**8, "delayed_shift": 2})
    scaler = ShardLossScaler(args, torch.device("cpu"))
    scales = []
    for _ in range(3):
        params = _params([math.inf])
        assert not scaler.unscale([p.grad for p in params])
        scaler.finish_step(params)
        scales.append(scaler.loss_scale)
    assert scales == [2.0**8, 2.0**7, 2.0**6]  # delayed_shift 2: the first overflow only spends the hysteresis
