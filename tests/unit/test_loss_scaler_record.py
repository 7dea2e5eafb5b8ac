"""The dynamic fp16 loss scale in layout-independent checkpoints (runtime/checkpoint/universal.py):
recorded from, and restored into, DeepSpeed's own scaler classes: ``DynamicLossScaler`` (its ZeRO
optimizers and the pipeline engine) and ``LossScaleConfig`` (its fp16 optimizer without ZeRO). The
end-to-end pipeline resume is tests/distributed/test_reshard_checkpoint.py; DeepSpeed has no fp16 on
CPU, so its engine's side is checked here."""

import json

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScaler

from smp_adapter.runtime.checkpoint.universal import restore_scaler, scaler_record


def _dynamic(init_scale=2.0**16):
    return DynamicLossScaler(init_scale=init_scale, scale_window=4, min_scale=1, delayed_shift=2,
                             consecutive_hysteresis=False, raise_error_at_min_scale=False, dtype=torch.float16)


def test_a_dynamic_scale_continues_where_the_saving_job_left_it():
    saved = _dynamic()  # as after overflows up to iteration 2 (hysteresis 2 used up) and four clean steps
    saved.cur_scale, saved.cur_iter, saved.last_overflow_iter, saved.cur_hysteresis = 2.0**14, 7, 2, 1
    record = json.loads(json.dumps(scaler_record(saved)))  # it travels in the JSON manifest
    assert record == {"cur_scale": 2.0**14, "cur_iter": 7, "last_overflow_iter": 2, "cur_hysteresis": 1}
    resumed = _dynamic()
    restore_scaler(resumed, record)
    assert (resumed.cur_scale, resumed.cur_iter, resumed.last_overflow_iter, resumed.cur_hysteresis) == (
        2.0**14, 7, 2, 1)
    # the same next decision: 4 (scale_window) clean iterations since the overflow, so the scale grows;
    # a scaler restarted from its options would not (1 iteration since its start)
    saved.update_scale(False)
    resumed.update_scale(False)
    assert resumed.cur_scale == saved.cur_scale == 2.0**15
    fresh = _dynamic()
    fresh.update_scale(False)
    assert fresh.cur_scale == 2.0**16


def test_fp16_optimizer_without_zero_keeps_its_scale_in_loss_scale_config():
    args = {"init_scale": 2.0**10, "scale_window": 100, "min_scale": 1.0}
    saved = LossScaleConfig(torch.float16, True, 1.0, args)
    saved.cur_scale, saved.cur_iter, saved.last_overflow_iter = 2.0**7, 12, 9
    resumed = LossScaleConfig(torch.float16, True, 1.0, args)
    restore_scaler(resumed, scaler_record(saved))
    assert (resumed.cur_scale, resumed.cur_iter, resumed.last_overflow_iter) == (2.0**7, 12, 9)


def test_a_static_scale_is_neither_recorded_nor_overwritten():
    assert scaler_record(LossScaler(scale=128.0)) is None
    assert scaler_record(None) is None
    static = LossScaler(scale=128.0)
    restore_scaler(static, {"cur_scale": 4.0, "cur_iter": 3})  # the resuming job's static option wins
    assert static.cur_scale == 128.0
    fresh = _dynamic()
    restore_scaler(fresh, None)  # saved without one (fp32, bf16): this job's initial scale
    assert fresh.cur_scale == 2.0**16
