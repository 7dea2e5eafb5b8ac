"""A SageMaker job (distribution dict / smp options) -> a launch command (pure; runs nothing).

One world, ``nnodes x nprocs_per_node`` processes, validated against the degrees with ParallelDims
before any command is built; each launcher's line is its own (launch/launchers.py).

Environment (as the SageMaker SDK/toolkit set it): SM_HP_MP_PARAMETERS (compact key-sorted JSON
of the options as given), SM_FRAMEWORK_PARAMS, SM_NUM_GPUS (0 with cpu=True), DS_ACCELERATOR=cpu
with cpu=True; the launcher adds what its ranks need (MASTER_ADDR/MASTER_PORT for mpirun, MASTER_PORT
for srun, custom_mpi_options' -x exports for deepspeed and torchrun).
"""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from smp_adapter.config.dims import ParallelDims, sdp_engine_from, with_layout_problems
from smp_adapter.config.distribution import JobSpec
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import ENV_MP_PARAMETERS, SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.errors import SMPConfigError
from smp_adapter.launch.launchers import World, launcher_named

DEFAULT_MASTER_PORT = 29500  # torch.distributed's and DeepSpeed's default (SageMaker used 7777)


@dataclass(frozen=True)
class LaunchPlan:
    launcher: str
    command: tuple[str, ...]
    env: Mapping[str, str]  # set these in the launcher's environment
    nprocs_per_node: int
    nnodes: int
    notes: tuple[str, ...] = field(default=())  # what the user must know or do by hand

    @property
    def world_size(self) -> int:
        return self.nprocs_per_node * self.nnodes

    def to_dict(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "command": list(self.command), "env": dict(self.env),
                "nprocs_per_node": self.nprocs_per_node, "nnodes": self.nnodes, "notes": list(self.notes)}

    def shell(self) -> str:
        """One shell line, as the launcher writes it (``VAR=value ... command``)."""
        return launcher_named(self.launcher).shell(self.env, self.command)


def resolve_processes(job: JobSpec, cfg: SMPConfig, nprocs_per_node: int | None = None,
                      nnodes: int | None = None) -> tuple[int, int]:
    """(nnodes, nprocs_per_node): explicit values, else the job's instance_count and
    mpi.processes_per_host, else the smallest valid world pp x tp x sdp spread over the nodes."""
    nnodes = job.instance_count if nnodes is None else nnodes
    _check_count("instance_count", nnodes)
    if nprocs_per_node is None:
        nprocs_per_node = job.processes_per_host
    if nprocs_per_node is None:
        world = cfg.pipeline_parallel_degree * cfg.tensor_parallel_degree * cfg.sharded_data_parallel_degree
        if world % nnodes:
            raise_if_any([ConfigProblem("mpi.processes_per_host", f"is not given and the smallest valid world size "
                                        f"({world} = pp x tp x sdp) does not split over {nnodes} instances",
                                        "give processes_per_host (GPUs per instance)")])
        nprocs_per_node = world // nnodes
    _check_count("processes_per_host", nprocs_per_node)
    return nnodes, nprocs_per_node


def job_config(job: JobSpec, world_size: int | None = None, nprocs_per_node: int | None = None,
               nnodes: int | None = None) -> SMPConfig:
    """The job's options. Invalid ones are refused with what the layout rules also find on the job's world
    (``world_size``, else as resolve_processes reads it), so one message lists every problem."""
    try:
        return job.config()
    except SMPConfigError as exc:
        if world_size is None and exc.partial is not None:
            try:
                world_size = math.prod(resolve_processes(job, exc.partial, nprocs_per_node, nnodes))
            except SMPConfigError:  # no world to judge the layout on: the options' own problems are the message
                pass
        raise with_layout_problems(exc, world_size, sdp_engine_from(os.environ)) from None


def _check_count(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise_if_any([ConfigProblem(key, "must be an integer >= 1", "give a positive number of processes/instances", value)])
    if value > MAX_WORLD_SIZE:
        raise_if_any([ConfigProblem(key, f"must be <= {MAX_WORLD_SIZE} (smp-adapter's limit on processes, MAX_WORLD_SIZE)",
                                    "give a real number of processes/instances", value)])


def to_launch_plan(job: JobSpec, cfg: SMPConfig | None, script: str, script_args: Sequence[str] = (),
                   launcher: str = "deepspeed", nprocs_per_node: int | None = None, hostfile: str | None = None,
                   master_addr: str | None = None, master_port: int | None = None, cpu: bool = False,
                   nnodes: int | None = None, hosts: Sequence[str] | None = None,
                   python: str = "python", node_rank: int | None = None,
                   dims: ParallelDims | None = None) -> LaunchPlan:
    """The command that starts ``script`` as this job. Raises SMPConfigError when the world
    size does not fit the degrees (ParallelDims.from_config) or an argument is invalid. ``dims``:
    the layout the caller already placed on this world (a translate bundle places it once)."""
    cfg = job_config(job, None, nprocs_per_node, nnodes) if cfg is None else cfg
    runner = launcher_named(launcher)
    nnodes, nprocs = resolve_processes(job, cfg, nprocs_per_node, nnodes)
    if dims is None or dims.cfg != cfg or dims.world_size != nnodes * nprocs:
        ParallelDims.from_config(cfg, nnodes * nprocs)  # the degrees must fit this world
    port = master_port if master_port is not None else (cfg.ddp_port or DEFAULT_MASTER_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise_if_any([ConfigProblem("master_port", "must be a TCP port (1-65535)", "e.g. 29500", port)])
    hosts = list(hosts) if hosts else (["localhost"] if nnodes == 1 else [f"algo-{i + 1}" for i in range(nnodes)])
    if len(hosts) != nnodes:
        raise_if_any([ConfigProblem("hosts", f"must name {nnodes} hosts (instance_count)", "give one host per instance", hosts)])
    addr = master_addr or ("127.0.0.1" if nnodes == 1 else hosts[0])
    world = World(nnodes, nprocs, tuple(hosts), addr, master_addr, port, hostfile, node_rank, python,
                  (script, *map(str, script_args)), parse_custom_mpi_options(job.custom_mpi_options))
    env = _sagemaker_env(job, nprocs, cpu)
    command, notes = runner.line(world, env)
    return LaunchPlan(launcher, tuple(command), env, nprocs, nnodes, tuple(notes))


def _sagemaker_env(job: JobSpec, nprocs: int, cpu: bool) -> dict[str, str]:
    env = {
        ENV_MP_PARAMETERS: json.dumps(dict(job.options), sort_keys=True, separators=(",", ":")),
        "SM_FRAMEWORK_PARAMS": json.dumps({
            "sagemaker_distributed_dataparallel_enabled": False,
            "sagemaker_mpi_custom_mpi_options": job.custom_mpi_options,
            "sagemaker_mpi_enabled": True,
            "sagemaker_mpi_num_of_processes_per_host": nprocs,
        }, sort_keys=True, separators=(",", ":")),
        "SM_NUM_GPUS": "0" if cpu else str(nprocs),
    }
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


@dataclass
class CustomMPIOptions:
    """custom_mpi_options split the way the SageMaker toolkit reads them."""

    nccl_debug: str | None = None  # "--NCCL_DEBUG X" is the toolkit's own flag, not mpirun's
    mca: dict[str, str] = field(default_factory=dict)  # -mca/--mca NAME VALUE (last one wins)
    exports: dict[str, str] = field(default_factory=dict)  # -x VAR=VALUE
    tokens: list[str] = field(default_factory=list)  # everything else, in order (including -x VAR)

    def other_flags(self) -> list[str]:
        return [*self.tokens, *(t for name, value in self.mca.items() for t in ("-mca", name, value))]


def parse_custom_mpi_options(text: str) -> CustomMPIOptions:
    try:
        tokens = shlex.split(text or "")
    except ValueError as exc:
        raise_if_any([ConfigProblem("mpi.custom_mpi_options", f"cannot be split into flags ({exc})",
                                    "balance the quotes", text)])
    out = CustomMPIOptions()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--NCCL_DEBUG"):
            if "=" in tok:
                out.nccl_debug = tok.split("=", 1)[1]
            elif i + 1 < len(tokens):
                out.nccl_debug, i = tokens[i + 1], i + 1
        elif tok in ("-mca", "--mca") and i + 2 < len(tokens):
            out.mca.pop(tokens[i + 1], None)  # keep the last value, at its position
            out.mca[tokens[i + 1]] = tokens[i + 2]
            i += 2
        elif tok == "-x" and i + 1 < len(tokens) and "=" in tokens[i + 1]:
            name, value = tokens[i + 1].split("=", 1)
            out.exports[name] = value
            out.tokens += [tok, tokens[i + 1]]
            i += 1
        else:
            out.tokens.append(tok)
        i += 1
    return out

