"""One object per launcher: its command line, how the job's environment reaches its ranks, its dry-run text.

Every launcher starts one world, ``nnodes x nprocs_per_node`` processes (launch/command.py validates it
against the degrees first). Each object builds two lines: ``line``, the pure one translate shows (and
launch/command.py's LaunchPlan holds), and ``run_line``, the one ``smp-adapter launch`` runs, which puts this
Python, the launcher's program and its rank-log flags at the head of ``line``.

  deepspeed  deepspeed --num_gpus N [--num_nodes K --hostfile H] [--master_addr A] --master_port P
             --no_local_rank script args
             ``--num_gpus`` (not ``--include``): on CPU DeepSpeed's resource pool has one slot per
             NUMA node (or $LOCAL_SIZE), and --num_gpus N replaces the slot list by range(N)
             whatever the pool says, while --include rejects slots missing from the pool
             (deepspeed/launcher/runner.py). One node needs no hostfile and no pdsh: without
             /job/hostfile the runner starts the processes locally. ``--no_local_rank``: smp
             scripts do not parse ``--local_rank``; the runtime reads $LOCAL_RANK.
  torchrun   torchrun --nproc_per_node N --nnodes K --node_rank R --master_addr A --master_port P
             script args       (R is 0 on one node, the literal ${NODE_RANK} on several)
  mpirun     the SageMaker training toolkit's mpirun line minus its SageMaker-only parts (network
             interface names, the gethostname LD_PRELOAD shim, smddpmprun, EFA and NCCL tuning),
             then ``python script args``: no ``-m mpi4py``, the runtime reads OMPI_COMM_WORLD_*
             and ``-mca orte_abort_on_non_zero_status 1`` already ends the job when a rank fails
             (Open MPI 4; Open MPI 5's prterun ends it by default and ignores the ORTE name).
             ``--bind-to``/``--map-by`` are spelled with two dashes: the toolkit's ``-bind-to``
             works only on Open MPI 4, prterun (5.x) reads it as the executable's name.
  srun       srun --nodes K --ntasks-per-node N --kill-on-bad-exit=1 --label --export=ALL python
             script args     (inside a Slurm allocation: salloc, or an sbatch script; the runtime reads
             SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID and takes the master from the nodelist)

How the job's environment reaches the ranks: torchrun's ranks inherit it; mpirun exports what ``-x``
names; srun's ``--export=ALL`` hands it on; the deepspeed runner on several nodes forwards only what its
deepspeed_env file lists (launch/env_bundle.py). ``-x VAR=VALUE`` exports from custom_mpi_options go into
the environment of the deepspeed/torchrun launches (on the mpirun line they stay flags).
"""

from __future__ import annotations

import shlex
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, MutableMapping, Sequence

from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.errors import SMPAdapterError
from smp_adapter.launch.env_bundle import deepspeed_env_file
from smp_adapter.launch.inputs import launcher_program

if TYPE_CHECKING:  # launch/command.py builds the world from the job and imports this module
    from smp_adapter.launch.command import CustomMPIOptions, LaunchPlan
    from smp_adapter.launch.job import LaunchJob

NODE_RANK_PLACEHOLDER = "${NODE_RANK}"  # expanded by the shell on each node
# MCA parameters on the toolkit's base line, in order. A custom option naming one of them is not
# repeated (Open MPI: "MCA parameters can only be listed once"): the same value is
# dropped, a different value replaces the base value.
BASE_MCA = (("plm_rsh_no_tree_spawn", "1"), ("pml", "ob1"), ("btl", "^openib"),
            ("orte_abort_on_non_zero_status", "1"), ("btl_vader_single_copy_mechanism", "none"))


@dataclass(frozen=True)
class World:
    """What a launcher's line is built from: the validated world and where its ranks meet."""

    nnodes: int
    nprocs: int
    hosts: tuple[str, ...]
    addr: str  # the master: as given, else 127.0.0.1 on one node, else the first host
    master_addr: str | None  # as given
    port: int
    hostfile: str | None
    node_rank: int | None
    python: str
    args: tuple[str, ...]  # the script and its arguments, which end every line
    custom: CustomMPIOptions


class Launcher(ABC):
    """What every launcher answers. The defaults are the common case: the ranks inherit the launch's
    environment, one node needs nothing more, and --node-rank is torchrun's alone."""

    name = ""
    tails_rank_logs = False  # the supervisor reads each rank's output from its own log file (deepspeed)

    @abstractmethod
    def line(self, world: World, env: MutableMapping[str, str]) -> tuple[list[str], list[str]]:
        """The command and the notes for the user; may add what the ranks need to ``env``."""

    def shell(self, env: Mapping[str, str], command: Sequence[str]) -> str:
        """One shell line: ``VAR=value ... command``; ${NODE_RANK} stays unquoted for the shell."""
        assigned = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
        return " ".join(assigned + [a if a == NODE_RANK_PLACEHOLDER else shlex.quote(a) for a in command])

    def check_nodes(self, nnodes: int, hostfile: str | None, node_rank: int | None, master_addr: str | None) -> None:
        """launch's refusals for this launcher's node arguments, before any rank starts."""
        if node_rank is not None:
            raise SMPAdapterError("--node-rank is for --launcher torchrun (deepspeed, mpirun and srun start every node "
                                  "themselves)")

    def watches_other_nodes(self, nnodes: int) -> bool:
        """Whether each node's launch process heartbeats with the others' (launch/node_heartbeat.py)."""
        return False

    def pass_env(self, env: MutableMapping[str, str], job_dir: Path, nnodes: int) -> str | None:
        """What carries ``env`` to the ranks beyond inheriting it: the text of a file launch writes, or None."""
        return None

    def run_line(self, plan: LaunchPlan, tail: int, env: Mapping[str, str], logs: Path, dry_run: bool) -> tuple[str, ...]:
        """The line launch runs: ``plan.command`` with its head rewritten; its last ``tail`` words (the script
        and its arguments) stay as they are."""
        head, rest = list(plan.command[:-tail]), list(plan.command[-tail:])
        return (*self._run_head(head, plan, env, logs, dry_run), *rest)

    @abstractmethod
    def _run_head(self, head: list[str], plan: LaunchPlan, env: Mapping[str, str], logs: Path,
                  dry_run: bool) -> list[str]:
        """The head of the line launch runs (the launcher program and its flags)."""

    def dry_run_text(self, job: LaunchJob) -> str:
        """What ``launch --dry-run`` prints: the world, the variables set, the exact command, the notes."""
        lines = [f"# smp-adapter launch: {job.summary}", "# environment set for the job (on top of the current one):",
                 *(f"export {name}={shlex.quote(value)}" for name, value in job.env.items()), shlex.join(job.command),
                 *self._env_passing_text(job), *(f"# note: {note}" for note in job.notes)]
        return "\n".join(lines) + "\n"

    def _env_passing_text(self, job: LaunchJob) -> list[str]:
        return []


def _exports_into_env(custom: CustomMPIOptions, env: MutableMapping[str, str]) -> list[str]:
    """custom_mpi_options' ``-x VAR=VALUE`` and ``--NCCL_DEBUG`` for a launcher that is not mpirun."""
    env.update(custom.exports)
    if custom.nccl_debug:
        env["NCCL_DEBUG"] = custom.nccl_debug
    if custom.other_flags():
        return [f"custom_mpi_options flags {' '.join(custom.other_flags())!r} only apply to the mpirun launcher"]
    return []


def _needs_hostfile(name: str, nnodes: int, hostfile: str | None) -> None:
    if nnodes > 1 and not hostfile:
        raise SMPAdapterError(f"{nnodes} nodes with {name}: give --hostfile (or use --launcher torchrun with "
                              "--node-rank, or --launcher srun inside a Slurm allocation)")


class DeepSpeed(Launcher):
    name = "deepspeed"
    module = "deepspeed.launcher.runner"  # run with this interpreter, so the ranks get it too
    tails_rank_logs = True  # --enable_each_rank_log: one file per rank, no prefix on the runner's output

    def line(self, world, env):
        notes = _exports_into_env(world.custom, env)
        command = ["deepspeed", "--num_gpus", str(world.nprocs)]
        if world.nnodes > 1:
            command += ["--num_nodes", str(world.nnodes), "--hostfile", world.hostfile or "hostfile"]
            notes.append("several nodes: the deepspeed launcher needs a hostfile ('<host> slots=N' per line), "
                         "passwordless ssh and pdsh, and forwards only the variables listed in .deepspeed_env")
        if world.master_addr:
            command += ["--master_addr", world.master_addr]
        return [*command, "--master_port", str(world.port), "--no_local_rank", *world.args], notes

    def check_nodes(self, nnodes, hostfile, node_rank, master_addr):
        _needs_hostfile(self.name, nnodes, hostfile)
        super().check_nodes(nnodes, hostfile, node_rank, master_addr)

    def pass_env(self, env, job_dir, nnodes):
        if nnodes == 1:  # one node: the runner's ranks inherit the environment
            return None
        text = deepspeed_env_file(env)  # pdsh forwards only what this file lists (launch/env_bundle.py)
        env["DS_ENV_FILE"] = str(job_dir / "deepspeed_env")
        return text

    def _run_head(self, head, plan, env, logs, dry_run):
        return [sys.executable, "-m", self.module, *head[1:], "--enable_each_rank_log", str(logs),
                "--log_level", self.log_level(plan.nnodes)]

    @staticmethod
    def log_level(nnodes: int) -> str:
        """The runner's --log_level (it passes it on to its per-node launch.py). Its INFO lines repeat what
        launch prints itself (the command, the world) and name CUDA_VISIBLE_DEVICES on CPU jobs too; on one
        node its only warning is the hostfile it never needs (launch passes none there), so only errors are
        shown. On several nodes its warnings stay."""
        return "error" if nnodes == 1 else "warning"

    def _env_passing_text(self, job):
        if not job.deepspeed_env:
            return []
        return [f"# written at launch to {job.env['DS_ENV_FILE']} (DS_ENV_FILE), for the ranks on other hosts:",
                *(f"#   {line}" for line in job.deepspeed_env.splitlines())]


class Torchrun(Launcher):
    name = "torchrun"
    module = "torch.distributed.run"  # run with this interpreter, so the ranks get it too

    def line(self, world, env):
        notes = _exports_into_env(world.custom, env)
        node_rank = (str(world.node_rank) if world.node_rank is not None else
                     "0" if world.nnodes == 1 else NODE_RANK_PLACEHOLDER)
        command = ["torchrun", "--nproc_per_node", str(world.nprocs), "--nnodes", str(world.nnodes),
                   "--node_rank", node_rank, "--master_addr", world.addr, "--master_port", str(world.port), *world.args]
        if node_rank == NODE_RANK_PLACEHOLDER:
            notes.append("several nodes: run the same command on every node with NODE_RANK set to 0..nnodes-1")
        return command, notes

    def check_nodes(self, nnodes, hostfile, node_rank, master_addr):
        if nnodes > 1 and (node_rank is None or not master_addr):
            raise SMPAdapterError("torchrun on several nodes: run this command on every node with --node-rank R "
                                  "(0..nnodes-1) and --master-addr <address of node 0>")

    def watches_other_nodes(self, nnodes):
        return nnodes > 1  # every node has its own launch: they watch each other

    def _run_head(self, head, plan, env, logs, dry_run):
        return [sys.executable, "-m", self.module, *head[1:], "--tee", "3", "--log-dir", str(logs)]


class Mpirun(Launcher):
    name = "mpirun"

    def line(self, world, env):
        env.update({"MASTER_ADDR": world.addr, "MASTER_PORT": str(world.port)})
        notes, mca = self._mca(world.custom)
        placement = (["--hostfile", world.hostfile] if world.hostfile else
                     ["--host", ",".join(f"{h}:{world.nprocs}" for h in world.hosts)])
        cmd = ["mpirun", *placement, "-np", str(world.nprocs * len(world.hosts)), "--allow-run-as-root",
               "--display-map", "--tag-output", "--bind-to", "none", "--map-by", "slot"]
        for name, value in mca.items():
            cmd += ["-mca", name, value]
        cmd += ["-x", f"NCCL_DEBUG={world.custom.nccl_debug or 'INFO'}", "-x", "LD_LIBRARY_PATH", "-x", "PATH",
                *world.custom.tokens]
        for name in env:  # mpirun exports only what -x names
            cmd += ["-x", name]
        return [*cmd, world.python, *world.args], notes

    @staticmethod
    def _mca(custom: CustomMPIOptions) -> tuple[list[str], dict[str, str]]:
        """The base line's MCA parameters with custom_mpi_options' merged in (each named once)."""
        notes: list[str] = []
        base = dict(BASE_MCA)
        extra = {}
        for name, value in custom.mca.items():
            if name not in base:
                extra[name] = value
            elif value == base[name]:
                notes.append(f"custom_mpi_options repeats '-mca {name} {value}', already on the base line: not repeated")
            else:
                notes.append(f"custom_mpi_options sets '-mca {name} {value}': replaces the base line's value "
                             f"{base[name]!r}")
                base[name] = value
        return notes, {**base, **extra}

    def check_nodes(self, nnodes, hostfile, node_rank, master_addr):
        _needs_hostfile(self.name, nnodes, hostfile)
        super().check_nodes(nnodes, hostfile, node_rank, master_addr)

    def _run_head(self, head, plan, env, logs, dry_run):
        # the variables launch adds are exported with -x too (the line names plan.env's); the interpreter ends head
        extra = [t for name in env if name not in plan.env for t in ("-x", name)]
        return [launcher_program("mpirun", required=not dry_run), *head[1:-1], *extra, head[-1]]


class Srun(Launcher):
    name = "srun"

    def line(self, world, env):
        # Slurm picks the hosts; the ranks take the master from its nodelist (launch/rank_env.py)
        env["MASTER_PORT"] = str(world.port)
        command = ["srun", "--nodes", str(world.nnodes), "--ntasks-per-node", str(world.nprocs), "--kill-on-bad-exit=1",
                   "--label", "--export=ALL", world.python, *world.args]
        return command, ["srun runs inside a Slurm allocation (salloc, or an sbatch script with "
                         f"--nodes={world.nnodes} --ntasks-per-node={world.nprocs})"]

    def _run_head(self, head, plan, env, logs, dry_run):  # --export=ALL hands the ranks this environment
        return [launcher_program("srun", required=not dry_run), *head[1:]]


_BY_NAME = {launcher.name: launcher for launcher in (DeepSpeed(), Torchrun(), Mpirun(), Srun())}
LAUNCHERS = tuple(_BY_NAME)  # what --launcher and a recipe's launcher accept


def launcher_named(name: str) -> Launcher:
    if name not in _BY_NAME:
        raise_if_any([ConfigProblem("launcher", "is not a known launcher", f"Available: {', '.join(LAUNCHERS)}", name)])
    return _BY_NAME[name]
