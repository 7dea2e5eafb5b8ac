"""What pipeline parallelism supports, checked in smp.init (before any process group exists)."""

from __future__ import annotations

from smp_adapter.errors import UnsupportedFeatureError


def check_pipeline_config(cfg, dims) -> None:
    problems = []
    # shard_optimizer_state (ZeRO-1) is carried out by smp_adapter/pipeline/sharded_optimizer.py
    if dims.zero_stage > 1:
        problems.append("parameter sharding (sharded_data_parallel_degree; smp v1 does not combine it with pipeline "
                        "parallelism either): use shard_optimizer_state: true to shard optimizer state, or "
                        "pipeline_parallel_degree: 1 with sharded_data_parallel_degree")
    if problems:
        raise UnsupportedFeatureError(
            f"pipeline_parallel_degree={dims.pp} is carried out by torch.distributed.pipelining, which smp-adapter "
            "does not combine with: " + "; ".join(problems) + " (docs/pipeline.md)")
