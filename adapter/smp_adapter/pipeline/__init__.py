"""Pipeline parallelism (pipeline_parallel_degree > 1) on torch.distributed.pipelining.

See docs/pipeline.md. The runtime (DistributedModel, @smp.step, DistributedOptimizer) delegates to
``PipelineRunner`` when pp > 1.
"""

from smp_adapter.pipeline.runtime import PipelineRunner, bound_microbatches

__all__ = ["PipelineRunner", "bound_microbatches"]
