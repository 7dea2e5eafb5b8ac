"""smp options -> a DeepSpeed config dict (pure; no deepspeed import).

Mapping (design.md §2):
  ddp, no sharding                 -> ZeRO stage 0 (plain data-parallel all-reduce)
  shard_optimizer_state            -> ZeRO stage 1
  sharded_data_parallel_degree     -> ZeRO stage 3 (+ zero_hpz_partition_size = sdp when sdp < rdp)
  microbatches                     -> gradient_accumulation_steps; micro batch = batch / microbatches
  fp16 / bf16                      -> fp16 (dynamic or static loss scale) / bf16
  sdp_gradient_clipping            -> gradient_clipping (only under sdp; DeepSpeed >= 0.19.3 defaults
                                      to 1.0, so 0.0 is emitted explicitly to mean "off")
  offload_activations              -> activation_checkpointing.cpu_checkpointing

Batch arithmetic: per optimizer step each data-parallel rank runs `microbatches` microbatches of
``train_micro_batch_size_per_gpu`` samples; DeepSpeed derives train_batch_size = micro x gas x
(data-parallel world size of the engine), so only micro + gas are emitted (DeepSpeed issue 7298).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from smp_adapter.config.dims import ParallelDims

# Apex/smp dynamic loss scaling arguments (spec §2.8) and their DeepSpeed fp16 keys.
DEFAULT_DYNAMIC_LOSS_ARGS = {"init_scale": 2**32, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1,
                             "delayed_shift": 1, "consecutive_hysteresis": False}


@dataclass(frozen=True)
class LossScaleArgs:
    """What ``smp.DistributedOptimizer(static_loss_scale=..., dynamic_loss_scale=..., ...)`` said."""

    static_loss_scale: float | None = 1.0
    dynamic_loss_scale: bool = False
    init_scale: float = 2**32
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1
    delayed_shift: int = 1
    consecutive_hysteresis: bool = False


def fp16_section(loss: LossScaleArgs) -> dict[str, Any]:
    if loss.dynamic_loss_scale or loss.static_loss_scale is None:
        # DeepSpeed takes the initial scale as a power of two: 2**32 -> 32.
        power = max(0, round(float(loss.init_scale)).bit_length() - 1)
        return {"enabled": True, "loss_scale": 0, "initial_scale_power": power,
                "loss_scale_window": int(loss.scale_window), "hysteresis": int(loss.delayed_shift),
                "consecutive_hysteresis": bool(loss.consecutive_hysteresis), "min_loss_scale": max(1, math.ceil(loss.min_scale))}  # DeepSpeed takes an int
    return {"enabled": True, "loss_scale": float(loss.static_loss_scale)}


def to_deepspeed_config(dims: ParallelDims, per_rank_batch: int | None = None,
                        loss_scale: LossScaleArgs | None = None) -> dict[str, Any]:
    """The DeepSpeed config for this job.

    ``per_rank_batch`` is the batch each rank passes to smp.step (default: one sample per
    microbatch; the engine only uses it for throughput figures and batch-size checks).
    """
    cfg = dims.cfg
    per_rank_batch = cfg.microbatches if per_rank_batch is None else per_rank_batch
    micro = dims.micro_batch_size(per_rank_batch)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": cfg.microbatches,
        "gradient_clipping": float(cfg.sdp_gradient_clipping) if dims.sdp > 1 else 0.0,
        "steps_per_print": 2**31 - 1,  # smp scripts print their own progress
        "zero_allow_untested_optimizer": True,  # any torch optimizer works under smp
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(dims),
    }
    if cfg.fp16:
        ds["fp16"] = fp16_section(loss_scale or LossScaleArgs())
    if cfg.bf16:
        ds["bf16"] = {"enabled": True}
    if cfg.offload_activations:
        ds["activation_checkpointing"] = {"cpu_checkpointing": True, "partition_activations": False,
                                          "contiguous_memory_optimization": False}
    if dims.pp > 1:
        ds["pipeline"] = {"stages": dims.pp, "activation_checkpoint_interval": 0}
    return ds


def _zero_section(dims: ParallelDims) -> dict[str, Any]:
    cfg = dims.cfg
    stage = dims.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update({
            "reduce_bucket_size": int(cfg.sdp_reduce_bucket_size),
            "stage3_param_persistence_threshold": int(cfg.sdp_param_persistence_threshold),
            "stage3_max_live_parameters": int(cfg.sdp_max_live_parameters),
            # Gather the full (unsharded) weights for state_dict(): smp full checkpoints need them.
            "stage3_gather_16bit_weights_on_model_save": True,
        })
        if dims.hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = dims.hpz_partition_size
    return zero
