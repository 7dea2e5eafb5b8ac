"""Pipeline parallelism (pipeline_parallel_degree > 1) on torch.distributed.pipelining.

See docs/pipeline.md. The pipeline engine (runtime/engines/pipeline_engine.py) drives ``PipelineRunner``.
"""

from smp_adapter.pipeline.runtime import PipelineRunner

__all__ = ["PipelineRunner"]
