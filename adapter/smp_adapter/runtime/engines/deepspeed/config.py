"""The job's one DeepSpeed config: built once by smp.init from the layout (``build_job_config``, kept
in the job as ``job.engine_config``), read by the wrap-time partitioning (zero.Init's arguments) and by
``deepspeed.initialize``; the last adds only what DistributedModel / DistributedOptimizer's arguments
decide (translate/deepspeed.with_engine_arguments)."""

from __future__ import annotations

import copy


def build_job_config(dims, backend: str | None) -> dict:
    from smp_adapter.translate.deepspeed import to_deepspeed_config

    return to_deepspeed_config(dims, backend=backend)


def job_config(job) -> dict:
    """A copy of the config smp.init built for ``job`` (DeepSpeed may write into the dict it is given)."""
    return copy.deepcopy(job.engine_config)


def engine_config(job, loss_scale, backward_passes_per_step: int) -> dict:
    """What ``deepspeed.initialize`` gets: the job's config with the optimizer's loss-scale arguments
    and the model's backward_passes_per_step."""
    from smp_adapter.translate.deepspeed import with_engine_arguments

    return with_engine_arguments(job_config(job), job.dims, loss_scale, backward_passes_per_step)
