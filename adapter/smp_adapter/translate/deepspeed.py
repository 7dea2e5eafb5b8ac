"""smp options -> a DeepSpeed config dict (pure; no deepspeed import): the one config of a job.

The runtime builds its DeepSpeed engine (and zero.Init) from ``to_deepspeed_config`` with the
job's backend and backward_passes_per_step; ``smp-adapter translate`` prints the same function's
output. Which DeepSpeed entries each smp option decides is ``DEEPSPEED_KEYS`` below, held once:
the emitter writes those entries, ``translate --explain`` reads them back from the emitted config,
and a test checks docs/translation.md's table against it.

Batch arithmetic: per optimizer step each data-parallel rank runs `microbatches` microbatches of
``train_micro_batch_size_per_gpu`` samples; DeepSpeed derives train_batch_size = micro x gas x
(data-parallel world size of the engine), so only micro + gas are emitted (DeepSpeed issue 7298).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

from smp_adapter.config.dims import ParallelDims

# smp option -> the DeepSpeed entries (dotted paths) it decides.
DEEPSPEED_KEYS: dict[str, tuple[str, ...]] = {
    "ddp": ("zero_optimization.stage",),  # 0: plain data-parallel all-reduce
    "shard_optimizer_state": ("zero_optimization.stage",),  # 1
    "sharded_data_parallel_degree": ("zero_optimization.stage", "zero_optimization.zero_hpz_partition_size"),  # 3 (+ hpZ)
    "microbatches": ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"),
    "pipeline_parallel_degree": ("pipeline.stages",),
    "fp16": ("fp16.enabled",),  # loss scale from DistributedOptimizer's arguments
    "bf16": ("bf16.enabled",),
    "offload_activations": ("activation_checkpointing.cpu_checkpointing",),
    "sdp_reduce_bucket_size": ("zero_optimization.reduce_bucket_size",),
    "sdp_param_persistence_threshold": ("zero_optimization.stage3_param_persistence_threshold",),
    # DeepSpeed releases a gathered layer by its reuse distance alone: one bound for both (ZERO3_BUFFERS)
    "sdp_max_live_parameters": ("zero_optimization.stage3_max_live_parameters",
                                "zero_optimization.stage3_max_reuse_distance"),
    # only under sdp; DeepSpeed >= 0.19.3 defaults to 1.0, so 0.0 is emitted otherwise to mean "off"
    "sdp_gradient_clipping": ("gradient_clipping",),
}
# sharded data parallel options copied unchanged (as integers) into their DeepSpeed entries
SDP_COPIED = ("sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters")


def deepspeed_value(config, path: str):
    """The value at a dotted path of a DeepSpeed config (None when absent)."""
    for part in path.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)
    return config


def _put(config: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[leaf] = value


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


# Apex/smp dynamic loss scaling arguments (smp.DistributedOptimizer's dynamic_loss_args): their names and
# defaults, LossScaleArgs' fields after the two switches (fp16_section maps them to DeepSpeed's fp16 keys).
DEFAULT_DYNAMIC_LOSS_ARGS = {f.name: f.default for f in fields(LossScaleArgs)
                             if f.name not in ("static_loss_scale", "dynamic_loss_scale")}


def fp16_section(loss: LossScaleArgs) -> dict[str, Any]:
    if loss.dynamic_loss_scale or loss.static_loss_scale is None:
        # DeepSpeed takes the initial scale as a power of two: 2**32 -> 32.
        power = max(0, round(float(loss.init_scale)).bit_length() - 1)
        return {"enabled": True, "loss_scale": 0, "initial_scale_power": power,
                "loss_scale_window": int(loss.scale_window), "hysteresis": int(loss.delayed_shift),
                "consecutive_hysteresis": bool(loss.consecutive_hysteresis), "min_loss_scale": max(1, math.ceil(loss.min_scale))}  # DeepSpeed takes an int
    return {"enabled": True, "loss_scale": float(loss.static_loss_scale)}


def to_deepspeed_config(dims: ParallelDims, per_rank_batch: int | None = None,
                        loss_scale: LossScaleArgs | None = None, backward_passes_per_step: int = 1,
                        backend: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config for this job: the one the runtime's engine is built with.

    ``per_rank_batch`` is the batch each rank passes to smp.step (default: one sample per
    microbatch; the engine only uses it for throughput figures and batch-size checks).
    ``backward_passes_per_step`` (a DistributedModel argument): step calls per optimizer step.
    ``backend`` ("nccl" / "gloo"; None when translating for a job not yet launched): decides
    overlap_comm for ZeRO 1/3 (see _zero_section).
    """
    cfg = dims.cfg
    per_rank_batch = cfg.microbatches if per_rank_batch is None else per_rank_batch
    micro = dims.micro_batch_size(per_rank_batch)
    arguments = _engine_arguments(dims, loss_scale, backward_passes_per_step)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": arguments.pop("gradient_accumulation_steps"),
        "gradient_clipping": float(cfg.sdp_gradient_clipping) if dims.sdp > 1 else 0.0,
        "steps_per_print": 2**31 - 1,  # smp scripts print their own progress
        "zero_allow_untested_optimizer": True,  # any torch optimizer works under smp
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_section(dims, backend),
        **arguments,  # fp16, when on
    }
    if cfg.bf16:
        ds["bf16"] = {"enabled": True}
    if cfg.offload_activations:
        ds["activation_checkpointing"] = {"cpu_checkpointing": True, "partition_activations": False,
                                          "contiguous_memory_optimization": False}
    if dims.pp > 1:
        ds["pipeline"] = {"stages": dims.pp, "activation_checkpoint_interval": 0}
    return ds


def with_engine_arguments(config: dict[str, Any], dims: ParallelDims, loss_scale: LossScaleArgs | None,
                          backward_passes_per_step: int) -> dict[str, Any]:
    """``config`` (``to_deepspeed_config(dims, ...)`` with the defaults) with what DistributedModel's and
    DistributedOptimizer's arguments decide: equal to ``to_deepspeed_config(dims, ..., loss_scale=...,
    backward_passes_per_step=...)``, without rebuilding the rest. A new dict; ``config`` is unchanged."""
    ds = copy.deepcopy(config)
    ds.update(_engine_arguments(dims, loss_scale, backward_passes_per_step))
    return ds


# ZeRO-3's buffers, by DeepSpeed's config key: the smp key that sets it (None: smp v1 has none), DeepSpeed's
# default (elements, sized for billion-parameter models), and whether a default larger than the model's
# largest parameter is bounded to it at wrap time. Only buffers that hold memory without changing what is
# communicated are bounded: the reduce bucket (a small model's rank filled it with the whole model's
# gradients) and the prefetch bucket (how far ahead layers are gathered). max_live_parameters and the reuse
# distance decide whether a layer gathered for forward stays gathered until its backward: with DeepSpeed's
# (and smp v1's) defaults a model below ~5e8 elements keeps every layer gathered (the whole model's
# parameters on every rank during the step, as the kernel counts it: RESULTS.md §18.2); a smaller value
# releases each layer after its forward and gathers it again for backward (1.5 x the all-gather traffic,
# what FSDP's reshard_after_forward does). A given sdp_max_live_parameters sets both: DeepSpeed releases
# by the reuse distance alone, so max live without it kept every layer gathered.
ZERO3_BUFFERS = {
    "reduce_bucket_size": ("sdp_reduce_bucket_size", int(5e8), True),
    "stage3_max_live_parameters": ("sdp_max_live_parameters", int(1e9), False),
    "stage3_prefetch_bucket_size": (None, int(5e7), True),
    "stage3_max_reuse_distance": ("sdp_max_live_parameters", int(1e9), False),
}
BUFFER_BOUND_WORDS = ("at wrap time, the reduce and prefetch buckets the smp options leave at DeepSpeed's default "
                      "are bounded by the model's largest parameter where the default is larger (a small model's "
                      "rank would otherwise hold the whole model's gradients in the reduce bucket); a value given "
                      "in the smp options is kept")
MAX_LIVE_WORDS = ("sets DeepSpeed's reuse distance too. DeepSpeed's default keeps every layer gathered from its "
                  "forward to its backward when the model has fewer elements: a rank then holds the whole "
                  "model's parameters during the step; a smaller value (e.g. the largest layer's elements) "
                  "releases each layer after its forward and gathers it again for its backward, trading 1.5 x "
                  "the all-gather traffic for that memory")


def zero3_buffer_sizes(cfg, largest_parameter: int) -> dict[str, int]:
    """The ZeRO-3 buffers a job runs with (elements, by DeepSpeed's key), the one home of the bound that
    the runtime applies at wrap time and plan predicts with: a value the smp options give is kept; a
    bounded buffer's default is cut to ``largest_parameter`` where larger (BUFFER_BOUND_WORDS; 0, an
    unknown model, leaves the defaults); the others keep DeepSpeed's defaults."""
    sizes = {}
    for key, (smp_key, default, bounded) in ZERO3_BUFFERS.items():
        if smp_key is not None and smp_key in cfg.given:
            sizes[key] = int(getattr(cfg, smp_key))
        else:
            sizes[key] = min(default, largest_parameter) if bounded and largest_parameter > 0 else default
    return sizes


def bounded_zero3_buffers(config: dict[str, Any], cfg, largest_parameter: int) -> tuple[dict[str, Any], dict]:
    """(``config`` with ZeRO-3's buffers at ``zero3_buffer_sizes``, {key: (was, now)} of what changed)."""
    zero = config.get("zero_optimization", {})
    if zero.get("stage") != 3 or largest_parameter <= 0:
        return config, {}
    out, changed = copy.deepcopy(config), {}
    for key, size in zero3_buffer_sizes(cfg, largest_parameter).items():
        default = ZERO3_BUFFERS[key][1]
        if zero.get(key, default) != size:
            out["zero_optimization"][key] = size
            changed[key] = (zero.get(key, default), size)
    return out, changed


def _engine_arguments(dims: ParallelDims, loss_scale: LossScaleArgs | None,
                      backward_passes_per_step: int) -> dict[str, Any]:
    """The entries DistributedModel's and DistributedOptimizer's arguments decide, written only here."""
    cfg = dims.cfg
    # engine.backward divides each microbatch loss by gradient_accumulation_steps: smp's average over
    # microbatches (the runtime sets the reduction boundary itself, after the last microbatch of every
    # backward_passes_per_step-th step call)
    entries: dict[str, Any] = {"gradient_accumulation_steps": cfg.microbatches * backward_passes_per_step}
    if cfg.fp16:
        entries["fp16"] = fp16_section(loss_scale or LossScaleArgs())
    return entries


def _zero_section(dims: ParallelDims, backend: str | None) -> dict[str, Any]:
    cfg = dims.cfg
    stage = dims.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if backend is not None and stage in (1, 3):
        # Overlapped reduction runs on CUDA streams; on CPU (gloo) it made no measurable difference
        # either way (benchmarks/RESULTS.md §1.4), so it is off there and on with NCCL.
        zero["overlap_comm"] = backend == "nccl"
    if stage == 3:
        for key in SDP_COPIED:
            for path in DEEPSPEED_KEYS[key]:
                _put(zero, path.removeprefix("zero_optimization."), int(getattr(cfg, key)))
        # Gather the full (unsharded) weights for state_dict(): smp full checkpoints need them.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if dims.hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = dims.hpz_partition_size
    return zero
