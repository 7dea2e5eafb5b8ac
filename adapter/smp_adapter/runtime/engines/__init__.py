"""The engines that carry out a DistributedModel, and the one place that chooses between them.

    layout (ParallelDims) --engine_name_for--> "deepspeed" | "pipeline" --create_engine--> Engine

* ``deepspeed``: pipeline_parallel_degree 1. A DeepSpeed engine (ZeRO 0/1/3, hpZ, fp16/bf16)
  over the whole module, tensor-parallel layers inside it (runtime/engines/deepspeed/engine.py).
* ``pipeline``: pipeline_parallel_degree > 1. torch.distributed.pipelining stages
  (runtime/engines/pipeline/), with smp's reductions, mixed precision and optimizer-state sharding
  (runtime/engines/pipeline/engine.py).

Engines are imported only when chosen (DeepSpeed and torch.export are heavy imports). The interface
is ``Engine`` in base.py.
"""

from __future__ import annotations

import importlib

from smp_adapter.errors import SMPUsageError

# name -> "module:class", imported lazily
ENGINES = {
    "deepspeed": "smp_adapter.runtime.engines.deepspeed.engine:DeepSpeedEngine",
    "pipeline": "smp_adapter.runtime.engines.pipeline.engine:PipelineEngine",
}


def engine_name_for(dims) -> str:
    """The engine a layout needs: the only branch on the pipeline degree outside the engines."""
    return "pipeline" if dims.pp > 1 else "deepspeed"


def engine_class(name: str):
    target = ENGINES.get(name)
    if target is None:
        raise SMPUsageError(f"no engine named {name!r}: the available engines are {', '.join(sorted(ENGINES))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_engine(model, dims, tp_originals: dict):
    """The engine for ``model`` under ``dims`` (called once, by DistributedModel)."""
    return engine_class(engine_name_for(dims))(model, tp_originals)
