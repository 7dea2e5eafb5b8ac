"""Who started this process, and where its ranks meet: read from the environment (pure).

Launchers recognised, first match wins:
  * torchrun / the deepspeed launcher / ``smp-adapter launch``: RANK, WORLD_SIZE, LOCAL_RANK
    (+ LOCAL_WORLD_SIZE or LOCAL_SIZE); they also set MASTER_ADDR/MASTER_PORT.
  * mpirun (Open MPI, as SageMaker ran v1 jobs): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE.
  * srun (Slurm): SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID, and the
    tasks on this node from SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE) at SLURM_NODEID.
  * nothing: a single process (rank 0 of 1).

Rendezvous (MASTER_ADDR, MASTER_PORT), first that applies:
  * address: MASTER_ADDR; else the first host of SLURM_STEP_NODELIST/SLURM_JOB_NODELIST (srun); else
    the first of SM_HOSTS (a SageMaker-style job); else 127.0.0.1 when every rank is on this node.
    Ranks on several nodes with none of these are refused: 127.0.0.1 would be a different
    machine for each node.
  * port: MASTER_PORT; else the options' ``ddp_port``; else SageMaker's 7777 under mpirun; else,
    under srun, 20000 + SLURM_JOB_ID mod 10000 (two jobs sharing a node do not collide, every rank
    of a job computes the same); else a free port for a single process.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from smp_adapter.errors import SMPUsageError

SAGEMAKER_MASTER_PORT = 7777
# set by smp-adapter launch: a rank that fails on its own writes its cause to rank<R>.txt there before the other
# ranks can abort it (runtime/agreement.py), and the launcher names it (launch/supervisor.py)
CAUSE_DIR_ENV = "SMP_ADAPTER_CAUSE_DIR"
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "torch", "mpirun", "srun" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_size: int

    @property
    def single_node(self) -> bool:
        return self.local_size >= self.world_size

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "LaunchEnv":
        if "RANK" in env and "WORLD_SIZE" in env:
            local_size = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or env["WORLD_SIZE"]
            return cls("torch", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0),
                       int(local_size))
        if "OMPI_COMM_WORLD_RANK" in env:
            return cls("mpirun", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                       _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1))
        tasks_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        if "SLURM_PROCID" in env and tasks_name in env:
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
            node = _int(env, "SLURM_NODEID", 0)
            counts = slurm_tasks_per_node(per_node) if per_node else []
            local_size = counts[node] if node < len(counts) else _int(env, tasks_name)
            return cls("srun", _int(env, "SLURM_PROCID"), _int(env, tasks_name), _int(env, "SLURM_LOCALID", 0),
                       local_size)
        return cls("none", 0, 1, 0, 1)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None and default is not None:
        return default
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise SMPUsageError(f"{name}={raw!r} is not an integer: the launcher that started this process set it; "
                            "start the job with torchrun, deepspeed, mpirun, srun or smp-adapter launch") from None


def rendezvous(launch: LaunchEnv, ddp_port: int | None, env: Mapping[str, str],
               free_port: Callable[[], int]) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for this job, by the rules in the module docstring."""
    addr = env.get("MASTER_ADDR") or _slurm_master(env, launch) or _sagemaker_master(env)
    if not addr:
        if not launch.single_node:
            raise SMPUsageError(
                f"{launch.world_size} ranks on several nodes ({launch.local_size} on this one) and no MASTER_ADDR: "
                "export MASTER_ADDR=<address of the node running rank 0> to every rank (mpirun -x MASTER_ADDR), "
                "or start the job with smp-adapter launch")
        addr = "127.0.0.1"
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    elif ddp_port:
        port = ddp_port
    elif launch.launcher == "mpirun":
        port = SAGEMAKER_MASTER_PORT
    elif launch.launcher == "srun" and env.get("SLURM_JOB_ID", "").isdigit():
        port = SLURM_PORT_BASE + int(env["SLURM_JOB_ID"]) % SLURM_PORT_SPAN
    elif launch.world_size == 1:
        port = free_port()
    else:
        raise SMPUsageError("MASTER_PORT is not set and the options give no ddp_port: launch with "
                            "`smp-adapter launch`, torchrun or deepspeed, or set MASTER_ADDR/MASTER_PORT")
    return addr, port


def _slurm_master(env: Mapping[str, str], launch: LaunchEnv) -> str | None:
    if launch.launcher != "srun":
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return slurm_first_host(nodelist) if nodelist else None


def _sagemaker_master(env: Mapping[str, str]) -> str | None:
    try:
        hosts = json.loads(env.get("SM_HOSTS", "[]"))
    except ValueError:
        return None
    # SageMaker's hosts are algo-1..algo-N; its launcher ran rank 0 on the first in sorted order
    return sorted(hosts)[0] if isinstance(hosts, list) and hosts and all(isinstance(h, str) for h in hosts) else None


def slurm_first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``gpu[03-05,9]-ib,login1`` -> ``gpu03-ib``."""
    first, depth = "", 0
    for ch in nodelist:  # the first top-level comma ends the first pattern
        if ch == "," and depth == 0:
            break
        depth += ch == "["
        depth -= ch == "]"
        first += ch
    # each [a-b,c] group stands for its first value, zero-padding kept
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first).strip()


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SMPUsageError(f"SLURM tasks per node {text!r} cannot be read: expected e.g. '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
