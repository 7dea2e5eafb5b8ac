"""DeepSpeed pieces the pipeline engine reuses (pp > 1 has no DeepSpeed engine, but the same
solver and loss scalers keep its numbers those of DeepSpeed at pp = 1). Imported lazily by callers."""

from __future__ import annotations


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's linear-partition solver: boundaries of ``parts`` contiguous runs of ``weights``."""
    from deepspeed.runtime.utils import partition_balanced as solve

    return solve(weights, parts)


def loss_scalers():
    """DeepSpeed's (DynamicLossScaler, LossScaler) classes."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    return DynamicLossScaler, LossScaler
