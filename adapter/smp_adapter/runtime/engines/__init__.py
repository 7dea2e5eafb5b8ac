"""The engines that carry out a job, and the one place that turns the layout's choice into a class.

    layout (ParallelDims.engine) --smp.init: engine_for--> Engine class
        --smp.init: engine_class(job, progress, warn_once)--> the job's one Engine instance (state.engine)
        --DistributedModel: attach_model--> the same instance, now driving the model (model.runtime_engine)

* ``deepspeed`` (deepspeed/): pipeline_parallel_degree 1. A DeepSpeed engine (ZeRO 0/1/3, hpZ,
  fp16/bf16) over the whole module, tensor-parallel layers inside it; everything that imports
  DeepSpeed lives in that folder.
* ``mics`` (mics/): pipeline_parallel_degree 1 and 1 < sharded_data_parallel_degree < rdp: smp v1's
  MiCS on torch FSDP2 (unless SMP_ADAPTER_SDP_ENGINE=hpz keeps DeepSpeed's ZeRO-3 + hpZ).
* ``pipeline`` (pipeline/): pipeline_parallel_degree > 1. torch.distributed.pipelining stages, with
  smp's reductions, mixed precision and optimizer-state sharding.

The engine is chosen when smp.init runs, before any model exists: the chosen class refuses what it
cannot run and starts the process group (before the job exists), then smp.init creates the one
instance from the job (runtime/job.py); what must happen before the model is built (the module-init
context of delayed initialisation, external parameters) is asked of that instance (``Engine`` in
base.py). Engines are imported only when chosen (DeepSpeed and torch.export are heavy imports).
"""

from __future__ import annotations

import importlib

from smp_adapter.errors import SMPUsageError

# name -> "module:class", imported lazily
ENGINES = {
    "deepspeed": "smp_adapter.runtime.engines.deepspeed.engine:DeepSpeedEngine",
    "pipeline": "smp_adapter.runtime.engines.pipeline.engine:PipelineEngine",
    "mics": "smp_adapter.runtime.engines.mics.engine:MicsEngine",
}


def engine_class(name: str):
    target = ENGINES.get(name)
    if target is None:
        raise SMPUsageError(f"no engine named {name!r}: the available engines are {', '.join(sorted(ENGINES))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def engine_for(dims):
    """The Engine class a layout needs (``ParallelDims.engine``, the one home of that rule): smp.init's choice."""
    return engine_class(dims.engine)
