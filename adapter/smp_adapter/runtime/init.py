"""``smp.init``: read the options, start torch.distributed under any launcher, build the groups.

Which launcher started this process (torchrun, deepspeed, mpirun, srun or none) and where the ranks
meet are read by ``launch/rank_env.py``. We export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT so libraries that read them (DeepSpeed, HF) agree with us.
Collective timeout: ``SMP_ADAPTER_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Mapping

from smp_adapter import run_shutdown_resets
from smp_adapter.config.dims import ParallelDims, sdp_engine_from, with_layout_problems
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPAdapterError, SMPConfigError, SMPUsageError, UnsupportedFeatureError
from smp_adapter.launch.free_port import free_port
from smp_adapter.ledger import record as comm_ledger
from smp_adapter.runtime import process_exit
from smp_adapter.runtime.job import Job
from smp_adapter.launch.rank_env import LaunchEnv, rendezvous
from smp_adapter.runtime.state import state, warn_once

DEFAULT_TIMEOUT_S = 600.0


def collective_timeout() -> timedelta:
    raw = os.environ.get("SMP_ADAPTER_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise SMPUsageError(f"SMP_ADAPTER_TIMEOUT={raw!r} is not a number of seconds: set e.g. SMP_ADAPTER_TIMEOUT=600")
    return timedelta(seconds=seconds)


def resolve_layout(config: Mapping[str, Any] | None, environ: Mapping[str, str]):
    """The pure part of smp.init: (options, ParallelDims, LaunchEnv) from the script's dict and the
    environment. Every layout rule is ParallelDims' own, so translate and launch (which build the
    same ParallelDims) accept and refuse exactly what smp.init does."""
    return place_options(read_options(config, environ), environ)


def read_options(config: Mapping[str, Any] | None, environ: Mapping[str, str]) -> SMPConfig:
    """``SMPConfig.from_sources``; invalid options are refused with the layout's problems on this
    process's world too, as translate and launch refuse them: one message, every problem."""
    try:
        return SMPConfig.from_sources(config, environ)
    except SMPConfigError as exc:
        try:
            world = LaunchEnv.from_environ(environ).world_size
        except SMPAdapterError:  # no readable world: the options' own problems are the message
            world = None
        raise with_layout_problems(exc, world, sdp_engine_from(environ)) from None


def place_options(cfg: SMPConfig, environ: Mapping[str, str]):
    """(options, ParallelDims, LaunchEnv) for options already read: the world this process is in."""
    launch = LaunchEnv.from_environ(environ)
    return cfg, ParallelDims.from_config(cfg, launch.world_size, sdp_engine_from(environ)), launch


def init(config: Mapping[str, Any] | None = None) -> None:
    """smp.init(): environment options (SM_HP_MP_PARAMETERS) override the script's dict. The options
    are read once; the layout names the engine (ParallelDims.engine), which is chosen here, before
    any model exists, and starts the process group and builds its one config for the job."""
    cfg = read_options(config, os.environ)
    if state.initialized:
        if cfg != state.cfg:
            raise SMPUsageError(
                "smp.init() was called again with different options; call it once at the start of the script "
                f"(first: {state.cfg.to_dict()}, now: {cfg.to_dict()})")
        return
    environ_before = dict(os.environ)
    cfg, dims, launch = place_options(cfg, os.environ)
    warn_once(cfg.warnings, launch.rank)
    kernel_switches(dims, launch.rank)
    import torch

    use_cuda = torch.cuda.is_available()
    backend = _choose_backend(cfg.ddp_dist_backend, use_cuda)
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
    _export_rendezvous(launch, cfg)
    import torch.distributed as dist

    from smp_adapter.runtime.engines import engine_for

    engine_class = engine_for(dims)  # the engine of this job, chosen before any model exists
    engine_class.refuse_unsupported(cfg)  # on every rank, before any collective
    engine_class.load_code(dims)
    state.owns_process_group = not dist.is_initialized()
    if state.owns_process_group:
        engine_class.start_process_group(backend, launch.rank, launch.world_size, collective_timeout(), use_cuda)
    state.cfg, state.dims, state.launcher, state.backend = cfg, dims, launch.launcher, backend
    state.rank, state.world_size = launch.rank, launch.world_size
    state.local_rank, state.local_size = launch.local_rank, launch.local_size
    state.device = torch.device("cuda", launch.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(state.device)
    _build_groups(dims, launch.rank, backend)
    # the one engine of the job, handed the job and the live step progress (it reads no global state)
    job = _job_of(state, engine_class.build_job_config(dims, backend))
    state.engine = engine_class(job, state.progress, warn_once)
    _set_tp_context()
    comm_ledger.install_if_requested(dims, launch.rank, launch.local_size)  # SMP_ADAPTER_COMM_LEDGER only
    if launch.rank == 0 and dims.chooses_sdp_engine:  # which of the two engines runs it
        import sys

        print(f"smp-adapter: {dims.describe()}; {dims.sdp_engine_note()}", file=sys.stderr, flush=True)
    state.initialized = True
    # what smp.init (and DeepSpeed's init_distributed) put into the environment: undone by shutdown()
    state.environ_changes = {k: environ_before.get(k) for k in set(environ_before) | set(os.environ)
                             if environ_before.get(k) != os.environ.get(k)}
    if state.owns_process_group:
        process_exit.leave_together_at_exit()


def _job_of(s, engine_config) -> Job:
    """The frozen description of the job smp.init set up in ``s`` (its groups are built)."""
    return Job(cfg=s.cfg, dims=s.dims, groups=s.groups, rank=s.rank, world_size=s.world_size,
               local_rank=s.local_rank, local_size=s.local_size, device=s.device, backend=s.backend,
               engine_config=engine_config)


def kernel_switches(dims: ParallelDims, rank: int) -> None:
    """SMP_ADAPTER_COMPILE read (a bad value, or blocks on a layout it cannot run, stops here, before
    any model exists) and the attention backends recorded from now on (runtime/attention.py)."""
    from smp_adapter.runtime import attention
    from smp_adapter.translate.kernels import compile_refusal, compile_setting_from

    if compile_setting_from(os.environ).on and compile_refusal(dims):
        raise UnsupportedFeatureError(compile_refusal(dims))
    attention.record_backends(rank)


def _choose_backend(requested: str, use_cuda: bool) -> str:
    if requested == "nccl" and not use_cuda:
        raise SMPUsageError("ddp_dist_backend: nccl needs CUDA GPUs, and none is visible: use ddp_dist_backend: auto "
                            "(gloo on CPU) or run on GPUs")
    if requested == "gloo":
        return "gloo"
    return "nccl" if use_cuda else "gloo"


def _export_rendezvous(launch: LaunchEnv, cfg: SMPConfig) -> None:
    env = os.environ
    env["MASTER_ADDR"], port = rendezvous(launch, cfg.ddp_port, env, free_port)
    env["MASTER_PORT"] = str(port)
    env["RANK"], env["WORLD_SIZE"] = str(launch.rank), str(launch.world_size)
    env["LOCAL_RANK"] = str(launch.local_rank)
    env.setdefault("LOCAL_WORLD_SIZE", str(launch.local_size))
    # DeepSpeed's CPU accelerator counts devices with `numactl` (two forks per ZeRO-3 reduce) unless
    # LOCAL_SIZE is set; the deepspeed launcher sets it, torchrun and mpirun do not.
    env.setdefault("LOCAL_SIZE", str(launch.local_size))


def _build_groups(dims: ParallelDims, rank: int, backend: str) -> None:
    """Create one torch.distributed group per smp group kind. Every rank creates every group, in
    the same order (torch requires it); each rank keeps the groups it belongs to."""
    import torch.distributed as dist

    grid = dims.grid
    world = dist.group.WORLD
    state.groups.world = world
    for kind in ("tp", "pp", "rdp", "dp", "mp"):
        mine = None
        for ranks in grid.groups(kind):
            if len(ranks) == dims.world_size:
                group = world  # whole world: no new communicator needed
            else:
                group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
        setattr(state.groups, kind, mine)
    if dims.mics_group_size > 1:  # MiCS: the chunks and the replicas across them (runtime/engines/mics/mesh.py)
        from smp_adapter.runtime.engines.mics.mesh import build_groups

        state.groups.sdp, state.groups.sdp_replicas = build_groups(dims, rank)
    if dims.hpz_partition_size > 1:  # hpZ: chunks of sdp ranks of each RDP group (runtime/engines/deepspeed/groups.py)
        for ranks in grid.sdp_groups(dims.sdp):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                state.groups.sdp = group
    # Pickled-object collectives (smp.broadcast/send/allgather) travel over gloo even in NCCL jobs.
    state.groups.objects = world if backend == "gloo" else dist.new_group(backend="gloo")


def _set_tp_context() -> None:
    if state.dims.tp == 1:
        return
    try:
        from smp_adapter.parallel.tensor import TPContext, set_current_tp_context
    except ImportError:  # tensor parallel engine not installed in this build
        return
    set_current_tp_context(TPContext(group=state.groups.tp, rank=state.coord.tp, size=state.dims.tp,
                                     prescaled_batch=state.cfg.prescaled_batch))


def shutdown() -> None:
    """Tear down what smp.init set up (tests and long-running notebooks)."""
    import torch.distributed as dist

    comm_ledger.close()
    if state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
        if state.engine is not None:
            state.engine.forget_process_group()
    for name, value in state.environ_changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    state.reset()  # also what warn_once has said
    run_shutdown_resets()  # the TP context, open marking contexts, the nn.Module.__init__ wrapper, smp.nn's flag
