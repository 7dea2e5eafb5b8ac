"""DeepSpeed pieces the pipeline and MiCS engines reuse (neither runs a DeepSpeed engine, but the same
solver and loss scalers keep their numbers those of DeepSpeed's ZeRO). Imported lazily by callers."""

from __future__ import annotations


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's linear-partition solver: boundaries of ``parts`` contiguous runs of ``weights``."""
    from deepspeed.runtime.utils import partition_balanced as solve

    return solve(weights, parts)


def loss_scalers():
    """DeepSpeed's (DynamicLossScaler, LossScaler) classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    return DynamicLossScaler, LossScaler


def make_loss_scaler(dtype, args):
    """The loss scaler smp.DistributedOptimizer's arguments (``args``: LossScaleArgs) ask for: fp16 with a dynamic
    scale (or no static one) gets DeepSpeed's DynamicLossScaler, else a LossScaler (static; 1.0 outside fp16:
    bf16 has fp32's exponent range)."""
    import torch

    DynamicLossScaler, LossScaler = loss_scalers()
    if dtype == torch.float16 and (args.dynamic_loss_scale or args.static_loss_scale is None):
        scaler = DynamicLossScaler(init_scale=args.init_scale, scale_window=args.scale_window,
                                   min_scale=args.min_scale, delayed_shift=args.delayed_shift,
                                   consecutive_hysteresis=args.consecutive_hysteresis,
                                   raise_error_at_min_scale=False, dtype=dtype)
        scaler.scale_factor = args.scale_factor  # DeepSpeed fixes it at 2; smp lets users choose it
        return scaler
    return LossScaler(scale=args.static_loss_scale if dtype == torch.float16 else 1.0)
