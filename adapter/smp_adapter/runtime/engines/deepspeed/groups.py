"""The process groups DeepSpeed is given: smp's, never DeepSpeed's own guesses.

* ``SMPMpu``: the ``mpu`` interface DeepSpeed asks for when tp > 1. Its data-parallel group is
  smp's RDP group, its model-parallel group smp's TP group.
* hpZ: DeepSpeed's secondary-partition group is smp's sharding group (``adopt_smp_hpz_group``).
"""

from __future__ import annotations

from smp_adapter.runtime.engines.deepspeed.config import job_config


class SMPMpu:
    """DeepSpeed's ``mpu`` backed by smp's groups (used when tp > 1)."""

    def __init__(self, job):
        self.g, self.c, self.d = job.groups, job.coord, job.dims

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


def mpu_or_none(job):
    return SMPMpu(job) if job.dims.tp > 1 else None


def adopt_smp_hpz_group(job) -> None:
    """hpZ (sharded_data_parallel_degree < rdp size): make DeepSpeed's secondary-partition group
    smp's sharding group (RankGrid.sdp_groups: consecutive chunks of this rank's RDP group).

    Left alone, DeepSpeed builds that group from consecutive *global* ranks. With tp > 1 those mix
    TP ranks, which hold different shards of each weight, and its secondary all-gather would then
    assemble weights from different shards. DeepSpeed has no public argument for the group its
    ZeRO-3 optimizer uses: it reads the module global below and builds its own only while it is
    None, so the group is put there before any zero.Init or deepspeed.initialize. shutdown()
    clears it with DeepSpeed's other cached groups (process_group.py)."""
    if job.dims.hpz_partition_size == 1:
        return
    from deepspeed.utils import groups as ds_groups

    if ds_groups._get_zero_param_intra_parallel_group() is None:
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = job.groups.sdp


def partition_module(module, job) -> None:
    """Shard the parameters of a built module as ZeRO-3 (``zero.Init(module=...)``), with the same
    config and groups. No dtype is passed: given a config and a dtype, DeepSpeed (0.14.1 through at
    least 0.19.8) evaluates ``dtype or fp16 if accel.is_fp16_supported() else bf16 if ...``, which by
    operator precedence is bfloat16 wherever the accelerator says fp16 is unsupported (its CPU
    accelerator on CPUs without AVX512-FP16/AMX); the caller casts the parameters first, and DeepSpeed
    does not cast them here."""
    import deepspeed

    deepspeed.zero.Init(module=module, config_dict_or_path=job_config(job), dtype=None, **_zero_init_groups(job))


def zero3_partitioner(job):
    """A function that makes the given whole parameters ZeRO-3 shards (each broadcast from its ZeRO
    group's first rank, then partitioned: this rank keeps its slice and frees the rest), with the job's
    config and groups. One ``zero.Init`` serves every call: building one parses the whole DeepSpeed
    config, and delayed initialisation partitions module by module. ``_convert_to_zero_parameters`` is
    what ``zero.Init(module=...)`` runs over a module's parameters (DeepSpeed 0.19.8), skipping shards."""
    import deepspeed
    from torch import nn

    # Given a module, zero.Init also turns on its memory-efficient linear, as deepspeed.initialize and
    # partition_module do: torch's own linear saves a transposed view of the gathered weight for
    # backward, which keeps every layer's gathered weight alive from forward to backward (the whole
    # model on each rank: +240 MiB for the 256 MiB MLP at sdp 2). An empty module converts nothing.
    init = deepspeed.zero.Init(module=nn.Module(), config_dict_or_path=job_config(job), dtype=None,
                               **_zero_init_groups(job))
    return init._convert_to_zero_parameters


def _zero_init_groups(job) -> dict:
    """The process-group arguments of ``deepspeed.zero.Init``: the ones DeepSpeed's engine uses."""
    adopt_smp_hpz_group(job)
    return {"data_parallel_group": job.groups.rdp, "mpu": mpu_or_none(job),
            "zero_param_parallel_group": job.groups.sdp if job.dims.hpz_partition_size > 1 else None}
