"""The job ``smp-adapter launch`` runs, built from its arguments before anything starts: the recipe and the
smp options resolved, the SageMaker environment of every rank (SM_* variables, the options, the apex
fallback, CUDA on CPU ranks), the launcher's command, the job's directories, the nodes' heartbeat settings,
and the checks that need no rank (process counts). commands/launch.py parses the arguments, checks storage and
hands this job to the supervisor (launch/supervisor.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from smp_adapter.compat.apex_fallback import BOOT_DIR as APEX_FALLBACK_BOOT, ENV as APEX_FALLBACK
from smp_adapter.config.distribution import job_from_mapping, load_mapping
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.launch.rank_env import CAUSE_DIR_ENV
from smp_adapter.launch.inputs import cuda_available, resolve_job, split_command
from smp_adapter.errors import SMPAdapterError, SMPConfigError
from smp_adapter.launch.free_port import free_port
from smp_adapter.launch.command import DEFAULT_MASTER_PORT, LaunchPlan, to_launch_plan
from smp_adapter.launch.launchers import LAUNCHERS, Launcher, launcher_named

CUDA_ON_CPU = "SMP_ADAPTER_CUDA_ON_CPU"
RANK_LOGS = Path("output", "rank-logs")  # each rank's output, under the job directory
RANK_CAUSES = Path("output", "rank-causes")  # a failing rank's cause, written before it raises (rank_env.CAUSE_DIR_ENV)
# rank variables of an enclosing launcher must not leak into this job
SCRUB = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK")


def load_recipe(path: str) -> dict[str, Any]:
    data, base, problems, out = load_mapping(path), Path(path).resolve().parent, [], {}
    checks = {"script": (str, "a path relative to the recipe"), "smp_options": (dict, "a mapping of smp options"),
              "nproc_per_node": (int, "a positive integer"), "hyperparameters": (dict, "a mapping"),
              "launcher": (str, f"one of {', '.join(LAUNCHERS)}")}
    for key, (kind, what) in checks.items():
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or isinstance(value, bool) or key == "launcher" and value not in LAUNCHERS:
            problems.append(ConfigProblem(f"{path}: {key}", f"must be {what}", f"write {key}: <{what}>", value))
        else:
            out[key] = str(base / value) if key == "script" else value
    raise_if_any(problems)
    out["job"] = job_from_mapping(out.pop("smp_options", {}), base)
    return out


def parse_pairs(items: list[str], flag: str, form: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SMPAdapterError(f"{flag} {item!r}: write {flag} {form}")
        out[key] = value
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _arg(value: Any) -> str:  # the SageMaker toolkit's rendering of a hyperparameter on the command line
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return value if isinstance(value, str) else str(value)


def _env_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", key).upper()


def _hosts(hostfile: str) -> dict[str, int | None]:
    """host -> slots (None where the line gives none), in the file's order."""
    try:
        lines = Path(hostfile).read_text().splitlines()
    except OSError as exc:
        raise SMPAdapterError(f"--hostfile {hostfile}: cannot be read ({exc.strerror}); write '<host> slots=N' lines") from None
    hosts = {}
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, *rest = line.split()
        slots = next((r.split("=", 1)[1] for r in rest if r.startswith("slots=")), None)
        if slots is not None and not (slots.isdigit() and int(slots) > 0):
            raise SMPAdapterError(f"--hostfile {hostfile}: {line.strip()!r}: slots must be a positive integer "
                                  "(write '<host> slots=N')")
        hosts[name] = int(slots) if slots is not None else None
    return hosts


def _slots_per_host(hosts: dict[str, int | None] | None) -> int | None:
    """The hostfile's slots when every host gives the same number (processes per node by default)."""
    slots = set((hosts or {}).values())
    return slots.pop() if len(slots) == 1 and None not in slots else None


def _check_counts(args: argparse.Namespace) -> None:
    """--nproc-per-node / --nnodes given on the command line: 1 .. MAX_WORLD_SIZE (0 is not "the default")."""
    problems = [ConfigProblem(flag, f"must be an integer between 1 and {MAX_WORLD_SIZE} (MAX_WORLD_SIZE)",
                              "give the number of processes per node (GPUs) and of nodes, or leave the flag out",
                              value)
                for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes))
                if value is not None and not 1 <= value <= MAX_WORLD_SIZE]
    raise_if_any(problems)


@dataclass(frozen=True)
class LaunchJob:
    """What one ``smp-adapter launch`` runs, built before anything starts."""

    command: tuple[str, ...]
    env: Mapping[str, str]  # the variables set for the job, on top of the launch's own environment
    plan: LaunchPlan  # the launcher's line as translate shows it, the world, the launcher's notes
    launcher: Launcher
    cpu: bool
    dirs: Mapping[str, Path]  # model, output, logs (the ranks' output), causes (a failing rank's cause)
    channels: Mapping[str, str]  # data channel -> its directory
    rank_offset: int  # the rank of this node's first process
    deepspeed_env: str | None  # the file written at DS_ENV_FILE (deepspeed on several nodes), else None
    heartbeat: Mapping[str, Any] | None  # NodeHeartbeat's arguments (torchrun on several nodes), else None
    notes: tuple[str, ...]

    @property
    def summary(self) -> str:
        return (f"{self.plan.nnodes} node(s) x {self.plan.nprocs_per_node} processes, launcher {self.launcher.name}, "
                f"{'CPU (gloo)' if self.cpu else 'GPU'}")

    def dry_run_text(self) -> str:
        return self.launcher.dry_run_text(self)


def build(args: argparse.Namespace, script_options) -> LaunchJob:
    """Everything a launch needs: command, the variables set, directories, supervision settings.
    ``script_options(script)``: the options the script gives smp.init, read statically (commands/launch.py
    hands in the static check's reader); launch-time options are checked merged with them."""
    _check_counts(args)
    recipe = load_recipe(args.recipe) if args.recipe else {}
    script, script_args, notes = _script_and_args(args, recipe)
    job, options_source = resolve_job(args.options, args.distribution, recipe, args.recipe, os.environ)
    launcher = launcher_named(args.launcher or recipe.get("launcher", "deepspeed"))
    cpu = args.device == "cpu" if args.device else not cuda_available()
    host_slots = _hosts(args.hostfile) if args.hostfile else None
    hosts, nnodes = _nodes(args, host_slots, job)
    launcher.check_nodes(nnodes, args.hostfile, args.node_rank, args.master_addr)
    nprocs = args.nproc_per_node if args.nproc_per_node is not None else (
        recipe.get("nproc_per_node") or job.processes_per_host or _slots_per_host(host_slots))
    if nprocs is None and not cpu:
        import torch

        nprocs = torch.cuda.device_count() or None
    cfg = _job_options(script_options(script), job, nnodes * nprocs if nprocs else None)
    job, hps, hp_args = _hyperparameters(args, recipe, job, cfg)
    port = args.master_port or (None if cfg.ddp_port or nnodes > 1 else free_port())
    plan = to_launch_plan(job, cfg, script, [*hp_args, *script_args], launcher=launcher.name, nprocs_per_node=nprocs,
                          hostfile=args.hostfile, master_addr=args.master_addr, master_port=port, cpu=cpu,
                          nnodes=nnodes, hosts=hosts, python=sys.executable, node_rank=args.node_rank)
    engine_note = _sdp_engine_note(cfg, plan.world_size)
    if engine_note:
        notes = [*notes, engine_note]
    node_rank = args.node_rank or 0
    if not 0 <= node_rank < plan.nnodes:
        raise SMPAdapterError(f"--node-rank {node_rank}: must be between 0 and nnodes - 1 = {plan.nnodes - 1}")
    job_dir = Path(args.job_dir).resolve()
    dirs = {"model": Path(args.model_dir or job_dir / "model").resolve(),
            "output": Path(args.output_data_dir or job_dir / "output" / "data").resolve(),
            "logs": job_dir / RANK_LOGS, "causes": job_dir / RANK_CAUSES}
    channels = {name: str(Path(path).resolve()) for name, path in parse_pairs(args.channel, "--channel", "NAME=PATH").items()}
    hosts = hosts or (["algo-1"] if nnodes == 1 else [f"algo-{i + 1}" for i in range(nnodes)])
    env = _sagemaker_env(script, hps, hp_args, channels, dirs, hosts, hosts[node_rank], plan)
    env.update(_process_env(args, cpu, dirs, plan.nprocs_per_node))
    deepspeed_env = launcher.pass_env(env, job_dir, plan.nnodes)
    tail = len(hp_args) + len(script_args) + 1  # the script and its arguments end every command
    command = launcher.run_line(plan, tail, env, dirs["logs"], args.dry_run)
    heartbeat = _heartbeat(args, cfg, port, node_rank, plan.nnodes) if launcher.watches_other_nodes(plan.nnodes) else None
    return LaunchJob(command, env, plan, launcher, cpu, dirs, channels, node_rank * plan.nprocs_per_node, deepspeed_env,
                     heartbeat, (options_source, *notes, *plan.notes))


def _script_and_args(args: argparse.Namespace, recipe: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """The script, its own arguments, and notes on how they were read."""
    positional = [*([args.script] if args.script else []), *args.script_args]
    if recipe.get("script"):  # the recipe names the script: every positional argument is the script's
        script, script_args, notes = recipe["script"], positional[1:] if positional[:1] == ["--"] else positional, []
    else:
        script, script_args, notes = split_command(positional)
    if not Path(script).is_file():
        raise SMPAdapterError(f"training script {script} not found: give the path of an existing file")
    return script, script_args, notes


def _nodes(args: argparse.Namespace, host_slots: dict[str, int | None] | None, job) -> tuple[list[str] | None, int]:
    """The hosts (the hostfile's first nnodes, or None) and the number of nodes."""
    hosts = list(host_slots) if host_slots is not None else None
    nnodes = args.nnodes if args.nnodes is not None else (len(hosts) if hosts else job.instance_count)
    if hosts is not None:
        if len(hosts) < nnodes:
            raise SMPAdapterError(f"--hostfile {args.hostfile} names {len(hosts)} hosts, fewer than --nnodes {nnodes}")
        hosts = hosts[:nnodes]
    return hosts, nnodes


def _hyperparameters(args: argparse.Namespace, recipe: dict[str, Any], job, cfg: SMPConfig):
    """(the job, its options completed as the ranks read them; the hyperparameters; the script's arguments
    they make, as the SageMaker toolkit passes them)."""
    hps = {**recipe.get("hyperparameters", {}), **{k: _json_or_text(v) for k, v in
                                                    parse_pairs(args.hyperparameter, "--hyperparameter", "KEY=VALUE").items()}}
    if job.options and getattr(args, "mp_parameters", True):
        hps.setdefault("mp_parameters", dict(job.options))  # as the SageMaker toolkit passes it
    if job.options and "partitions" not in job.options:
        # transformers' Trainer takes its smp path only when SM_HP_MP_PARAMETERS holds "partitions"
        # (is_sagemaker_mp_enabled): it is there whichever name of the pipeline degree the user wrote
        job = dataclasses.replace(job, options={**job.options, "partitions": cfg.partitions})
    return job, hps, [token for key in sorted(hps) for token in (f"--{key}", _arg(hps[key]))]


def _sagemaker_env(script: str, hps: dict[str, Any], hp_args: list[str], channels: dict[str, str],
                   dirs: dict[str, Path], hosts: list[str], current_host: str, plan: LaunchPlan) -> dict[str, str]:
    """The SM_* variables a SageMaker training container gives the script."""
    sm = {"SM_MODEL_DIR": str(dirs["model"]), "SM_OUTPUT_DATA_DIR": str(dirs["output"]),
          "SM_OUTPUT_DIR": str(dirs["output"].parent), "SM_CHANNELS": json.dumps(sorted(channels)),
          **{f"SM_CHANNEL_{_env_name(n)}": p for n, p in channels.items()},
          "SM_HPS": json.dumps(hps, sort_keys=True),
          **{f"SM_HP_{_env_name(k)}": v if isinstance(v, str) else json.dumps(v) for k, v in hps.items()},
          "SM_USER_ARGS": json.dumps(hp_args), "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": current_host,
          "SM_NUM_CPUS": str(os.cpu_count() or 1), "SM_USER_ENTRY_POINT": Path(script).name,
          "SM_MODULE_DIR": str(Path(script).resolve().parent)}
    sm.update(plan.env)  # SM_HP_MP_PARAMETERS (compact JSON), SM_FRAMEWORK_PARAMS, SM_NUM_GPUS, DS_ACCELERATOR
    sm["SM_TRAINING_ENV"] = json.dumps({
        "channel_input_dirs": channels, "current_host": sm["SM_CURRENT_HOST"], "hosts": hosts, "hyperparameters": hps,
        "model_dir": sm["SM_MODEL_DIR"], "output_data_dir": sm["SM_OUTPUT_DATA_DIR"], "output_dir": sm["SM_OUTPUT_DIR"],
        "num_gpus": int(sm["SM_NUM_GPUS"]), "num_cpus": int(sm["SM_NUM_CPUS"]), "user_entry_point": Path(script).name,
        "additional_framework_parameters": json.loads(sm["SM_FRAMEWORK_PARAMS"])}, sort_keys=True)
    return sm


def _process_env(args: argparse.Namespace, cpu: bool, dirs: dict[str, Path], nprocs_per_node: int) -> dict[str, str]:
    """What the ranks' processes need beyond SageMaker's variables: this package and the apex fallback on the
    path, unbuffered output, where a failing rank writes its cause, CPU threads, CUDA on CPU ranks."""
    env = {}
    root = Path(__file__).resolve().parents[2]  # the directory holding smp_adapter/ and smdistributed/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    front = [str(root)] if root.name not in ("site-packages", "dist-packages") else []  # smp_adapter without pip install
    if os.environ.get(APEX_FALLBACK) != "0":  # apex's names for the script from its first line (compat/apex_fallback/)
        front.append(APEX_FALLBACK_BOOT)
    if front:
        env["PYTHONPATH"] = os.pathsep.join([*front, *(p for p in paths if p not in front)])
    env["PYTHONUNBUFFERED"] = "1"
    env[CAUSE_DIR_ENV] = str(dirs["causes"])
    if args.comm_ledger:
        env["SMP_ADAPTER_COMM_LEDGER"] = str(Path(args.comm_ledger).resolve())
    if cpu and "OMP_NUM_THREADS" not in os.environ:  # torch's default (all cores per rank) oversubscribes
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs_per_node))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if cpu and os.environ.get(CUDA_ON_CPU) != "0":  # an unchanged GPU script runs on CPU ranks (compat/cuda_on_cpu.py)
        env[CUDA_ON_CPU] = "1"
    return env


def _heartbeat(args: argparse.Namespace, cfg: SMPConfig, port: int | None, node_rank: int, nnodes: int) -> dict[str, Any]:
    """NodeHeartbeat's arguments: every node's launch process watches the others' (launch/node_heartbeat.py)."""
    from smp_adapter.launch.node_heartbeat import timeout_from

    master_port = port if port is not None else (cfg.ddp_port or DEFAULT_MASTER_PORT)
    hb_port = args.node_heartbeat_port or master_port + 1
    node_timeout = timeout_from(args.node_timeout)
    if not (0 < hb_port < 65536 and node_timeout > 0):
        raise SMPAdapterError(f"--node-heartbeat-port {hb_port} / --node-timeout {node_timeout:g}: give a TCP port "
                              "(1-65535) and a positive number of seconds")
    return {"node_rank": node_rank, "nnodes": nnodes, "master_addr": args.master_addr, "port": hb_port,
            "timeout": node_timeout, "job_key": f"{nnodes}:{master_port}"}


def _job_options(in_script: dict, job, world_size: int | None) -> SMPConfig:
    """The options the ranks get (the script's smp.init dict, overridden by the launch's). Invalid ones are
    refused with the layout's problems on this world too, as translate does: one message, every problem."""
    from smp_adapter.config.dims import sdp_engine_from, with_layout_problems

    try:
        return SMPConfig.from_dict({**in_script, **job.options})
    except SMPConfigError as exc:
        raise with_layout_problems(exc, world_size, sdp_engine_from(os.environ)) from None


def _sdp_engine_note(cfg, world_size: int) -> str | None:
    """Which engine runs sharded_data_parallel_degree < rdp, and how to pick the other (ParallelDims)."""
    from smp_adapter.config.dims import ParallelDims, sdp_engine_from

    return ParallelDims.from_config(cfg, world_size, sdp_engine_from(os.environ)).sdp_engine_note()
