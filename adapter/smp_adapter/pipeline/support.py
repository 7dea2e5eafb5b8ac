"""What pipeline parallelism supports, checked in smp.init (before any process group exists)."""

from __future__ import annotations

from smp_adapter.errors import UnsupportedFeatureError


def check_pipeline_config(cfg, dims) -> None:
    problems = []
    if dims.zero_stage > 0:
        problems.append("optimizer-state or parameter sharding (shard_optimizer_state / sharded_data_parallel_degree): "
                        "remove it, or use pipeline_parallel_degree: 1 with sharding")
    if cfg.fp16 or cfg.bf16:
        problems.append("fp16/bf16 mixed precision: train in fp32 with pipelines, or use pipeline_parallel_degree: 1")
    if problems:
        raise UnsupportedFeatureError(
            f"pipeline_parallel_degree={dims.pp} is carried out by torch.distributed.pipelining, which smp-adapter "
            "does not combine with: " + "; ".join(problems) + " (docs/pipeline.md)")
