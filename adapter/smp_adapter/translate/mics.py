"""What each sharded-data-parallel key becomes on the MiCS engine (runtime/engines/mics: torch FSDP2
hybrid sharding), for ``translate --explain`` and docs/translation.md: one row per key, the one home of
these meanings. Pure data; the engine reads none of it (it has no knob these keys would turn)."""

from __future__ import annotations

from smp_adapter.config.dims import SDP_ENGINE_ENV

ENGINE = "MiCS engine: torch FSDP2 fully_shard on a (replicate, shard) DeviceMesh"

# smp key -> (engine setting, status, note)
MICS_KEYS = {
    "sdp_reduce_bucket_size": (
        "FSDP2 reduce-scatter per sharding unit", "approximated",
        "gradients are reduce-scattered one sharding unit (a transformer layer) per call, not in byte-sized buckets"),
    "sdp_param_persistence_threshold": (
        "FSDP2: every parameter sharded", "approximated",
        "no parameter is kept whole: small ones are gathered with the rest of their unit in the same all-gather"),
    "sdp_max_live_parameters": (
        "FSDP2 reshard after forward and backward, one unit prefetched", "approximated",
        "whole parameters live for the running unit and the one being prefetched, whatever the number"),
    "sdp_hierarchical_allgather": (
        "all-gathers inside the group of sdp ranks", "ignored",
        "MiCS gathers only inside its group by construction; no two-level gather is needed or done"),
    "sdp_gradient_clipping": (
        "clip inside optimizer.step() by the global norm of all shards", "exact",
        "the norm is summed over the group's shards (and the TP group's split parameters)"),
}


def layout_note(dims) -> str:
    return (f"groups of {dims.sdp} ranks shard parameters, gradients and optimizer state (1/{dims.sdp} each); "
            f"{dims.rdp // dims.sdp} replicas, whose gradient shards are all-reduced once per optimizer step. "
            f"{SDP_ENGINE_ENV}=hpz runs DeepSpeed ZeRO-3 + hpZ instead")
