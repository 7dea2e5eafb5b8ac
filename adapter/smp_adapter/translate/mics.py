"""The MiCS engine's side of translate (runtime/engines/mics: torch FSDP2 hybrid sharding): what each smp
key becomes on it (``MICS_KEYS``, the engine's key table for ``translate --explain`` and docs/translation.md;
translate/key_meanings.py says how the tables are read), what the engine is given (``mics_settings``) and
its sharding units' rule. The engine reads the units' rule; the key table is for explain only (the engine
has no knob these keys would turn)."""

from __future__ import annotations

from typing import Any

from smp_adapter.config.dims import SDP_ENGINE_ENV
from smp_adapter.translate.key_meanings import Facts, Meaning, Row, without_pipeline

ENGINE = "MiCS engine: torch FSDP2 fully_shard on a (replicate, shard) DeviceMesh"


def layout_note(dims) -> str:
    return (f"groups of {dims.sdp} ranks shard parameters, gradients and optimizer state (1/{dims.sdp} each); "
            f"{dims.rdp // dims.sdp} replicas, whose gradient shards are all-reduced once per optimizer step. "
            f"{SDP_ENGINE_ENV}=hpz runs DeepSpeed ZeRO-3 + hpZ instead")


def _groups(f: Facts) -> str:
    return f"{f.dims.rdp // f.dims.sdp} x {f.dims.sdp}"


def _replicas(f: Facts) -> str:
    rdp, sdp = f.dims.rdp, f.dims.sdp
    return f"over {rdp} data-parallel ranks ({rdp // sdp} MiCS replicas of {sdp}-rank groups)"


MICS_KEYS: dict[str, Row] = {
    **without_pipeline("mics"),
    "ddp": Meaning("data-parallel gradient reduction (MiCS engine, FSDP2)", "exact", _replicas),
    "sharded_data_parallel_degree": Meaning(ENGINE, "exact", lambda f: layout_note(f.dims), value=_groups),
    "sdp_reduce_bucket_size": Meaning(
        "FSDP2 reduce-scatter per sharding unit", "approximated",
        "gradients are reduce-scattered one sharding unit (a transformer layer, or one of a wide layer's projections) per call, not in byte-sized buckets"),
    "sdp_param_persistence_threshold": Meaning(
        "FSDP2: every parameter sharded", "approximated",
        "no parameter is kept whole: small ones are gathered with the rest of their unit in the same all-gather"),
    "sdp_max_live_parameters": Meaning(
        "FSDP2 reshard after forward and backward, one unit prefetched", "approximated",
        "whole parameters live for the running unit and the one being prefetched, whatever the number"),
    "sdp_hierarchical_allgather": Meaning(
        "all-gathers inside the group of sdp ranks", "ignored",
        "MiCS gathers only inside its group by construction; no two-level gather is needed or done", value=lambda f: "-"),
    "sdp_gradient_clipping": Meaning(
        "clip inside optimizer.step() by the global norm of all shards", "exact",
        "the norm is summed over the group's shards (and the TP group's split parameters)"),
    "microbatches": Meaning(
        "MiCS engine: microbatches one after another inside one smp.step call", "exact",
        "each microbatch's loss divided by microbatches; its gradients reduce-scattered inside the group, the "
        "replicas' all-reduce after the last microbatch"),
    "shard_optimizer_state": Meaning(
        "MiCS engine: optimizer state of the parameter shards", "exact",
        "sharded data parallel shards optimizer state already (the optimizer steps this rank's shards)"),
    "bf16": Meaning(
        "FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)", "exact",
        "bf16 compute and gathers, fp32 shards (the optimizer's masters), fp32 gradient reduction"),
    "fp16": Meaning(
        "FSDP2 MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32) + loss scaling", "exact",
        "fp16 compute and gathers, fp32 shards (the optimizer's masters), fp32 gradient reduction; the loss scaled "
        "by smp.DistributedOptimizer's static or dynamic loss scale (DeepSpeed's loss scalers), a step whose "
        "gradients overflow on any rank skipped on every rank"),
}


# The units' size rule: a submodule becomes a sharding unit once the parameters it holds outside other units reach
# this many elements (4 MiB in fp32), as FSDP's size-based wrap policy does. Below it one more gather per pass
# costs more in calls than the unit's bytes save. (runtime/engines/mics/units.py; plan/mics_units.py counts the
# same units from the model's spec)
UNIT_MIN_ELEMENTS = 1 << 20
# A transformer block is one unit unless it holds more than 1/BLOCK_SPLIT of the rank's shard of the model
# (model / sdp / BLOCK_SPLIT): then the size rule applies inside it too (its projections, one at a time). FSDP2
# holds ~2.5 x a unit while gathering it (the shard's copy-in, the all-gather output, the unsharded parameters)
# and prefetches one more, ~5 units at a moment: above a quarter of the shard that is more than the shard itself
# (RESULTS.md §20.2: GPT-2 of width 1024 at sdp 2, run peak 0.95 -> 0.71 x plain PyTorch's). Below it the
# extra calls cost more than they save (seed 002's ViT at sdp 4: its blocks are 1/12 of a shard).
BLOCK_SPLIT = 4


def splits_block(block_numel: int, model_numel: int, sdp: int) -> bool:
    """Whether a transformer block's own units come before it (the engine's and plan's one test)."""
    return block_numel * BLOCK_SPLIT * sdp > model_numel
# FSDP2's fully_shard(reshard_after_forward=...): a unit's whole parameters are freed after its forward
# and gathered again for its backward (smp v1's MiCS kept no gathered layer between the two either)
RESHARD_AFTER_FORWARD = True
UNITS_RULE = ("every element of an nn.ModuleList holding parameters (a transformer block), after the units inside "
              f"it when it holds more than 1/{BLOCK_SPLIT} of the rank's shard of the model; elsewhere (inside such a "
              f"block, or a model without blocks) every submodule whose parameters outside smaller units reach "
              f"{UNIT_MIN_ELEMENTS} elements, innermost first; the root module last, with what is left (embeddings, "
              "head, norms, tied weights)")


def mics_settings(dims) -> dict[str, Any]:
    """What the MiCS engine is given for this layout (runtime/engines/mics), for ``translate``: the
    DeviceMesh of each RDP group, its groups, the sharding units' rule, mixed precision, resharding and
    the replicas' all-reduce. JSON-ready; DeepSpeed's config is not used at sdp < rdp."""
    cfg, sdp = dims.cfg, dims.sdp
    compute = "float16" if cfg.fp16 else "bfloat16" if cfg.bf16 else "as created (float32)"
    return {
        "engine": ENGINE,
        "mesh": {"dims": ["replicate", "shard"], "shape": [dims.rdp // sdp, sdp],
                 "per": "each tensor-parallel rank's RDP group" if dims.tp > 1 else "the job's RDP group"},
        "shard_groups": [list(g) for g in dims.grid.sdp_groups(sdp)],
        "replicate_groups": [list(g) for g in dims.grid.sdp_replica_groups(sdp)],
        "sharding_units": UNITS_RULE,
        "mixed_precision": {"param_dtype": compute, "reduce_dtype": "float32" if cfg.fp16 or cfg.bf16 else compute,
                            "shards": "float32",
                            **({"loss_scaling": "smp.DistributedOptimizer's static or dynamic loss scale; steps "
                                                "whose gradients overflow skipped on every rank"} if cfg.fp16 else {})},
        "reshard_after_forward": RESHARD_AFTER_FORWARD,
        "gradient_reduction": ("reduce-scatter inside the shard group per unit in every backward (summed, then "
                               "divided once: gloo has no average); the replicate group's all-reduce of each "
                               "rank's shard once per optimizer step, in the last microbatch's backward"),
        "gradient_clipping": cfg.sdp_gradient_clipping,
        "delayed_initialization": ("each unit sharded in turn, each shard filled tensor by tensor from the "
                                   "record's replay (a from_pretrained file's tensors: the rank's rows read from "
                                   "the file)"),
    }
