"""Building the DeepSpeed engine that carries out a DistributedModel + DistributedOptimizer.

smp creates the optimizer *after* the model, while ``deepspeed.initialize`` wants both at once, so
the engine is built when ``smp.DistributedOptimizer`` is created (or at the first forward of a
model used without an optimizer, e.g. evaluation-only scripts).

Gradient accumulation: the engine's gradient_accumulation_steps is microbatches x
backward_passes_per_step, so ``engine.backward`` divides each microbatch loss by that number
(= the average over microbatches smp promises). The reduction boundary is set explicitly by the
step function (last microbatch of every backward_passes_per_step-th call), so gradients are
reduced when the step function returns, as smp v1 guarantees.
"""

from __future__ import annotations

from smp_adapter.runtime.state import state
from smp_adapter.translate.deepspeed import LossScaleArgs, to_deepspeed_config


class SMPMpu:
    """The ``mpu`` interface DeepSpeed asks for, backed by smp's groups (used when tp > 1):
    DeepSpeed's data-parallel group is smp's RDP group, its model-parallel group smp's TP group."""

    def __init__(self):
        self.g, self.c, self.d = state.groups, state.coord, state.dims

    def get_model_parallel_rank(self):
        return self.c.tp

    def get_model_parallel_world_size(self):
        return self.d.tp

    def get_model_parallel_group(self):
        return self.g.tp

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.c.rdp

    def get_data_parallel_world_size(self):
        return self.d.rdp

    def get_data_parallel_group(self):
        return self.g.rdp

    def get_pipeline_model_parallel_rank(self):
        return self.c.pp

    def get_pipeline_model_parallel_world_size(self):
        return self.d.pp

    def get_pipeline_model_parallel_group(self):
        return self.g.pp


def deepspeed_config(model, loss_scale: LossScaleArgs | None) -> dict:
    dims = state.dims
    config = to_deepspeed_config(dims, loss_scale=loss_scale)
    # Our step function owns the accumulation boundary; see module docstring.
    config["gradient_accumulation_steps"] = dims.cfg.microbatches * model.backward_passes_per_step
    if dims.zero_stage == 1 or dims.zero_stage == 3:
        # Overlapped reduction needs CUDA streams; on CPU it only adds work.
        config["zero_optimization"]["overlap_comm"] = state.backend == "nccl"
    return config


def build_engine(model, optimizer=None, loss_scale: LossScaleArgs | None = None):
    """deepspeed.initialize over the user's module (and the client optimizer, if any)."""
    import deepspeed

    config = deepspeed_config(model, loss_scale)
    mpu = SMPMpu() if state.dims.tp > 1 else None
    params = [p for p in model.module.parameters() if p.requires_grad] if optimizer is None else None
    engine, _, _, _ = deepspeed.initialize(model=model.module, optimizer=optimizer, config=config, mpu=mpu,
                                           model_parameters=params, dist_init_required=False)
    return engine
