"""The process groups DeepSpeed is given: smp's, never DeepSpeed's own guesses.

* ``SMPMpu``: the ``mpu`` interface DeepSpeed asks for when tp > 1. Its data-parallel group is
  smp's RDP group, its model-parallel group smp's TP group.
* hpZ: DeepSpeed's secondary-partition group is smp's sharding group (``adopt_smp_hpz_group``).
"""

from __future__ import annotations

import contextlib

from smp_adapter.runtime.engines.deepspeed.config import job_config
from smp_adapter.runtime.state import state


class SMPMpu:
    """DeepSpeed's ``mpu`` backed by smp's groups (used when tp > 1)."""

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


def mpu_or_none():
    return SMPMpu() if state.dims.tp > 1 else None


def adopt_smp_hpz_group() -> None:
    """hpZ (sharded_data_parallel_degree < rdp size): make DeepSpeed's secondary-partition group
    smp's sharding group (RankGrid.sdp_groups: consecutive chunks of this rank's RDP group).

    Left alone, DeepSpeed builds that group from consecutive *global* ranks. With tp > 1 those mix
    TP ranks, which hold different shards of each weight, and its secondary all-gather would then
    assemble weights from different shards. DeepSpeed has no public argument for the group its
    ZeRO-3 optimizer uses: it reads the module global below and builds its own only while it is
    None, so the group is put there before any zero.Init or deepspeed.initialize. shutdown()
    clears it with DeepSpeed's other cached groups (process_group.py)."""
    if state.dims.hpz_partition_size == 1:
        return
    from deepspeed.utils import groups as ds_groups

    if ds_groups._get_zero_param_intra_parallel_group() is None:
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = state.groups.sdp


def zero_init_context(dtype):
    """The ``deepspeed.zero.Init`` context delayed initialisation enters: the job's DeepSpeed config,
    the process groups its engine uses, and parameters created in ``dtype``.

    ``dtype`` is set on the object, not passed. DeepSpeed (0.14.1 through at least 0.19.8) decides
    the dtype in ``Init._set_dtype``; given a config *and* a dtype it evaluates
    ``dtype or fp16 if accel.is_fp16_supported() else bf16 if accel.is_bf16_supported else fp32``,
    which by operator precedence is bfloat16, whatever dtype was asked for, wherever the accelerator
    says fp16 is unsupported (DeepSpeed's CPU accelerator on CPUs without AVX512-FP16/AMX, e.g. AMD
    EPYC, answers ``None``). Given only the config it reads the precision options correctly; the
    public ``dtype`` attribute is what its tensor-creation hooks read on ``__enter__``, so setting it
    before entering covers ``model_creation(dtype=...)`` asking for something else."""
    import deepspeed
    import torch

    from smp_adapter.errors import UnsupportedFeatureError

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise UnsupportedFeatureError(
            f"delayed parameter initialization under sharded data parallel creates parameters in float32, "
            f"float16 or bfloat16 (what DeepSpeed's ZeRO-3 holds), not {dtype}; create the model with torch's "
            "default dtype float32 and choose half precision with the fp16/bf16 options")
    init = deepspeed.zero.Init(config_dict_or_path=job_config(), dtype=None, remote_device=None, enabled=True,
                               **_zero_init_groups())
    init.dtype = dtype
    return _with_group_root_broadcasts(init)


@contextlib.contextmanager
def _with_group_root_broadcasts(init):
    """``init`` entered, with DeepSpeed's ``Module.apply`` broadcasts sent from the ZeRO group's root.

    Under zero.Init, DeepSpeed (0.19.8) wraps ``nn.Module.apply``: it gathers each parameter, runs the
    function, then broadcasts from *global* rank 0 within the parameter's ZeRO group
    (``partition_parameters.py``: ``dist.broadcast(..., 0, group=param.ds_process_group)``). With
    tensor parallelism that group is the RDP group, which holds global rank 0 only on TP rank 0, so
    every other group stops with "Global rank 0 is not part of group". transformers 4.x initialises
    its weights through ``Module.apply`` (``post_init``), so tp 2 x sdp 2 with delayed initialisation
    failed there (5.x does not use ``apply``). While the context is open, a broadcast from rank 0 in
    a group without rank 0 is sent from the group's first rank, as DeepSpeed's own
    ``_zero_init_param`` does; every other call is DeepSpeed's unchanged."""
    import torch.distributed as dist
    from deepspeed.runtime.zero import partition_parameters

    comm = partition_parameters.dist

    class _GroupRootBroadcast:
        def __getattr__(self, name):
            return getattr(comm, name)

        def broadcast(self, tensor, src, group=None, *args, **kwargs):
            if src == 0 and group is not None:
                ranks = dist.get_process_group_ranks(group)
                if 0 not in ranks:
                    src = ranks[0]
            return comm.broadcast(tensor, src, group, *args, **kwargs)

    partition_parameters.dist = _GroupRootBroadcast()
    try:
        with init:
            yield init
    finally:
        partition_parameters.dist = comm


def partition_module(module) -> None:
    """Shard the parameters of a built module as ZeRO-3 (``zero.Init(module=...)``), with the same
    config and groups. No dtype is passed, for the reason in ``zero_init_context``: the caller casts
    the parameters first, and DeepSpeed does not cast them here."""
    import deepspeed

    deepspeed.zero.Init(module=module, config_dict_or_path=job_config(), dtype=None, **_zero_init_groups())


def zero3_partitioner():
    """A function that makes the given whole parameters ZeRO-3 shards (each broadcast from its ZeRO
    group's first rank, then partitioned: this rank keeps its slice and frees the rest), with the job's
    config and groups. One ``zero.Init`` serves every call: building one parses the whole DeepSpeed
    config, and delayed initialisation partitions module by module. ``_convert_to_zero_parameters`` is
    what ``zero.Init(module=...)`` runs over a module's parameters (DeepSpeed 0.19.8), skipping shards."""
    import deepspeed

    init = deepspeed.zero.Init(module=None, config_dict_or_path=job_config(), dtype=None, **_zero_init_groups())
    return init._convert_to_zero_parameters


def _zero_init_groups() -> dict:
    """The process-group arguments of ``deepspeed.zero.Init``: the ones DeepSpeed's engine uses."""
    adopt_smp_hpz_group()
    return {"data_parallel_group": state.groups.rdp, "mpu": mpu_or_none(),
            "zero_param_parallel_group": state.groups.sdp if state.dims.hpz_partition_size > 1 else None}
