"""torch.distributed started through DeepSpeed's communication layer, and DeepSpeed's cached groups
cleared when it ends. Both engines start the process group this way (the pipeline engine reuses
DeepSpeed's loss scalers and partition solver, parts.py), so a job starts the same at every pp."""

from __future__ import annotations


def start(backend: str, rank: int, world_size: int, timeout, use_cuda: bool) -> None:
    import deepspeed

    if not use_cuda:
        _skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=timeout, rank=rank, world_size=world_size)
    _groups_get_timeout(timeout)


def join_started_group() -> None:
    """DeepSpeed's communication layer over a torch process group already started (the MiCS engine's): its loss
    scalers ask it for this rank when they log an overflow. DeepSpeed wraps an initialised torch.distributed
    without starting anything."""
    import deepspeed
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        _skip_shm_allreduce()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)


def _groups_get_timeout(timeout) -> None:
    """Groups created later without a timeout (DeepSpeed's clone of the world for data parallelism,
    ours) get SMP_ADAPTER_TIMEOUT too, not torch's 30 minutes: a rank stuck in a collective is then
    reported by its peers after that timeout (torch reads these module defaults at each new_group)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    if getattr(distributed_c10d, "default_pg_nccl_timeout", None) is not None:
        distributed_c10d.default_pg_nccl_timeout = timeout


def _skip_shm_allreduce() -> None:
    """On CPU DeepSpeed's comm backend creates a ~64 MiB /dev/shm buffer per rank and job for its
    inference all-reduce kernel, and never unlinks it: every job leaks it, until /dev/shm (RAM) is
    full. smp training never calls that kernel (collectives go through torch.distributed/gloo), so
    the backend is built without it."""
    import importlib

    # importlib, not `import deepspeed.comm.torch as m`: deepspeed.comm's `torch` attribute is the
    # torch package itself, which that statement would return
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def forget_cached_groups() -> None:
    """DeepSpeed caches process groups in module globals; after the process group is destroyed a
    later smp.init must not reuse them."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and ("GROUP" in name or name.startswith("_MPU_")):
            if isinstance(value, dict):
                value.clear()
            elif not callable(value):
                setattr(groups, name, None)


class StartsThroughDeepSpeed:
    """The ``Engine`` class hooks of both engines (mixed in before ``Engine``): the process group
    starts through DeepSpeed's communication layer and DeepSpeed's cached groups are dropped when
    it ends."""

    @classmethod
    def start_process_group(cls, backend, rank, world_size, timeout, use_cuda) -> None:
        start(backend, rank, world_size, timeout, use_cuda)

    @classmethod
    def forget_process_group(cls) -> None:
        forget_cached_groups()
