"""``smp-adapter launch SCRIPT [ARGS...]``: run a SageMaker smp v1 training script, unchanged, under
deepspeed (default), torchrun or mpirun, with the environment its SageMaker job had.

The script gets SM_HP_MP_PARAMETERS (the smp options), SM_FRAMEWORK_PARAMS, SM_CHANNEL_<NAME> and
SM_CHANNELS, SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_OUTPUT_DIR, SM_NUM_GPUS, SM_NUM_CPUS, SM_HOSTS,
SM_CURRENT_HOST, SM_HPS, SM_HP_<NAME>, SM_USER_ARGS, SM_USER_ENTRY_POINT and SM_TRAINING_ENV;
hyperparameters (and, with smp options, ``--mp_parameters k=v,...`` as SageMaker passed it) come
first on the command line, as ``--key value`` sorted by key, then the script's own arguments.
Without a GPU (torch.cuda.is_available() false, or --cpu) the ranks use gloo and DS_ACCELERATOR=cpu.

Every rank's output is streamed; when a rank fails all ranks are stopped (SIGTERM, SIGKILL after
--grace seconds) and the exit status is the failing rank's (128+N if killed by signal N), 124 after
--timeout, 2 for bad options. --dry-run prints the environment it sets and the exact command.
A --recipe YAML holds ``script`` (relative to the YAML), ``smp_options``, ``nproc_per_node``,
``hyperparameters`` and optionally ``launcher``; command-line options win over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from smp_adapter.compat.apex_fallback import BOOT_DIR as APEX_FALLBACK_BOOT, ENV as APEX_FALLBACK
from smp_adapter.config.distribution import job_from_mapping, load_mapping
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.launch.inputs import cuda_available, launcher_program, resolve_job, split_command
from smp_adapter.launch.env_bundle import deepspeed_env_file
from smp_adapter.errors import SMPAdapterError
from smp_adapter.launch.free_port import free_port
from smp_adapter.launch.command import DEFAULT_MASTER_PORT, LAUNCHERS, to_launch_plan

NAME = "launch"
CUDA_ON_CPU = "SMP_ADAPTER_CUDA_ON_CPU"
# run the launchers with this interpreter, so the ranks get it too (both use sys.executable)
LAUNCHER_MODULES = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run"}
# rank variables of an enclosing launcher must not leak into this job
SCRUB = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="run a training script under deepspeed/torchrun/mpirun with SageMaker's environment",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, help="default: the recipe's launcher, else deepspeed")
    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="processes per node (default: recipe, mpi.processes_per_host, the hostfile's slots, #GPUs, "
                        "else pp x tp x sdp)")
    p.add_argument("--nnodes", type=int, metavar="K", help="nodes (default: hosts in --hostfile, else instance_count)")
    p.add_argument("--hostfile", metavar="H", help="'<host> slots=N' per line (deepspeed and mpirun on several nodes)")
    p.add_argument("--node-rank", type=int, metavar="R", help="this node's rank (torchrun on several nodes)")
    p.add_argument("--master-addr", metavar="A", help="rendezvous address (torchrun on several nodes: node 0)")
    p.add_argument("--master-port", type=int, metavar="P", help="rendezvous port (default: ddp_port, else a free port)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--options", metavar="FILE_OR_JSON", help="smp options or a distribution dict (file or inline JSON)")
    src.add_argument("--distribution", metavar="FILE", help="the estimator's distribution dict (JSON/YAML file)")
    src.add_argument("--recipe", metavar="RECIPE.yaml", help="recipe: script, smp_options, nproc_per_node, hyperparameters")
    p.add_argument("--channel", action="append", default=[], metavar="NAME=PATH", help="data channel (repeatable)")
    p.add_argument("--job-dir", default="smp-job", metavar="DIR",
                   help="default home of the model, output and rank-log directories (default: ./smp-job)")
    p.add_argument("--model-dir", metavar="DIR", help="SM_MODEL_DIR (default: JOB_DIR/model)")
    p.add_argument("--output-data-dir", metavar="DIR", help="SM_OUTPUT_DATA_DIR (default: JOB_DIR/output/data)")
    p.add_argument("--hyperparameter", "--hp", action="append", default=[], metavar="KEY=VALUE",
                   help="hyperparameter, passed as --KEY VALUE (VALUE is read as JSON when it parses; repeatable)")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="CPU ranks (gloo)")
    dev.add_argument("--gpu", dest="device", action="store_const", const="gpu", help="GPU ranks (default if CUDA works)")
    p.add_argument("--timeout", type=float, metavar="S", help="stop the job after S seconds (exit 124)")
    p.add_argument("--grace", type=float, default=20.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL, once a rank failed or when this command gets "
                        "SIGTERM/SIGINT (forwarded to every rank: a script can save its last checkpoint; default 20, "
                        "inside Kubernetes' 30)")
    p.add_argument("--node-timeout", type=float, metavar="S",
                   help="several nodes (torchrun): a node whose launch sends no heartbeat for S seconds is unreachable; "
                        "every node then stops its ranks and exits 125 naming it (default: SMP_ADAPTER_NODE_TIMEOUT, "
                        "else 120)")
    p.add_argument("--node-heartbeat-port", type=int, metavar="P",
                   help="several nodes (torchrun): node 0's port for the heartbeats (default: the master port + 1)")
    p.add_argument("--comm-ledger", metavar="DIR", help="every rank writes DIR/rank<r>.jsonl: its collective and "
                   "point-to-point traffic per training step (SMP_ADAPTER_COMM_LEDGER; smp-adapter report DIR)")
    p.add_argument("--no-mp-parameters", dest="mp_parameters", action="store_false",
                   help="do not pass --mp_parameters k=v,... to the script (SageMaker did; the options stay in "
                        "SM_HP_MP_PARAMETERS): for scripts whose argument parser refuses unknown arguments, such as "
                        "HfArgumentParser on transformers 5, whose TrainingArguments has no mp_parameters")
    p.add_argument("--dry-run", action="store_true", help="print the environment and command, run nothing")
    p.add_argument("script", nargs="?", metavar="SCRIPT",
                   help="training script (with a --recipe naming one, all positional arguments are the script's)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    return p


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


def _script_options(script: str) -> dict:
    """The options the script gives smp.init, read statically; launch-time options are checked merged
    with them. Unknown (no smp.init call found, or not a literal dict): assume ddp, smp.init checks."""
    from smp_adapter.check.script import script_options

    try:  # options only: the full check reads the runtime's classes, which imports torch (~1 s)
        options = script_options(Path(script).read_text(), script)
    except (SyntaxError, ValueError, OSError, SMPAdapterError):
        options = None
    return {"ddp": True} if options is None else options


def _check_counts(args: argparse.Namespace) -> None:
    """--nproc-per-node / --nnodes given on the command line: 1 .. MAX_WORLD_SIZE (0 is not "the default")."""
    problems = [ConfigProblem(flag, f"must be an integer between 1 and {MAX_WORLD_SIZE} (MAX_WORLD_SIZE)",
                              "give the number of processes per node (GPUs) and of nodes, or leave the flag out",
                              value)
                for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes))
                if value is not None and not 1 <= value <= MAX_WORLD_SIZE]
    raise_if_any(problems)


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a launch needs: command, the variables set, directories, supervision settings."""
    _check_counts(args)
    recipe = load_recipe(args.recipe) if args.recipe else {}
    positional = [*([args.script] if args.script else []), *args.script_args]
    if recipe.get("script"):  # the recipe names the script: every positional argument is the script's
        script, script_args, notes = recipe["script"], positional[1:] if positional[:1] == ["--"] else positional, []
    else:
        script, script_args, notes = split_command(positional)
    if not Path(script).is_file():
        raise SMPAdapterError(f"training script {script} not found: give the path of an existing file")
    job, options_source = resolve_job(args.options, args.distribution, recipe, args.recipe, os.environ)
    launcher = args.launcher or recipe.get("launcher", "deepspeed")
    if args.device:
        cpu = args.device == "cpu"
    else:
        cpu = not cuda_available()
    host_slots = _hosts(args.hostfile) if args.hostfile else None
    hosts = list(host_slots) if host_slots is not None else None
    nnodes = args.nnodes if args.nnodes is not None else (len(hosts) if hosts else job.instance_count)
    if hosts is not None:
        if len(hosts) < nnodes:
            raise SMPAdapterError(f"--hostfile {args.hostfile} names {len(hosts)} hosts, fewer than --nnodes {nnodes}")
        hosts = hosts[:nnodes]
    if nnodes > 1 and launcher in ("deepspeed", "mpirun") and not args.hostfile:
        raise SMPAdapterError(f"{nnodes} nodes with {launcher}: give --hostfile (or use --launcher torchrun with "
                              "--node-rank, or --launcher srun inside a Slurm allocation)")
    if nnodes > 1 and launcher == "torchrun" and (args.node_rank is None or not args.master_addr):
        raise SMPAdapterError("torchrun on several nodes: run this command on every node with --node-rank R "
                              "(0..nnodes-1) and --master-addr <address of node 0>")
    if args.node_rank is not None and launcher != "torchrun":
        raise SMPAdapterError("--node-rank is for --launcher torchrun (deepspeed, mpirun and srun start every node themselves)")
    nprocs = args.nproc_per_node if args.nproc_per_node is not None else (
        recipe.get("nproc_per_node") or job.processes_per_host or _slots_per_host(host_slots))
    if nprocs is None and not cpu:
        import torch

        nprocs = torch.cuda.device_count() or None
    cfg = SMPConfig.from_dict({**_script_options(script), **job.options})
    hps = {**recipe.get("hyperparameters", {}), **{k: _json_or_text(v) for k, v in
                                                    parse_pairs(args.hyperparameter, "--hyperparameter", "KEY=VALUE").items()}}
    if job.options and getattr(args, "mp_parameters", True):
        hps.setdefault("mp_parameters", dict(job.options))  # as the SageMaker toolkit passes it
    if job.options and "partitions" not in job.options:
        # transformers' Trainer takes its smp path only when SM_HP_MP_PARAMETERS holds "partitions"
        # (is_sagemaker_mp_enabled): it is there whichever name of the pipeline degree the user wrote
        job = dataclasses.replace(job, options={**job.options, "partitions": cfg.partitions})
    hp_args = [token for key in sorted(hps) for token in (f"--{key}", _arg(hps[key]))]
    port = args.master_port or (None if cfg.ddp_port or nnodes > 1 else free_port())
    plan = to_launch_plan(job, cfg, script, [*hp_args, *script_args], launcher=launcher, nprocs_per_node=nprocs,
                          hostfile=args.hostfile, master_addr=args.master_addr, master_port=port, cpu=cpu,
                          nnodes=nnodes, hosts=hosts, python=sys.executable,
                          node_rank=args.node_rank if launcher == "torchrun" else None)
    engine_note = _sdp_engine_note(cfg, plan.nnodes * plan.nprocs_per_node)
    if engine_note:
        notes = [*notes, engine_note]
    node_rank = args.node_rank or 0
    if not 0 <= node_rank < plan.nnodes:
        raise SMPAdapterError(f"--node-rank {node_rank}: must be between 0 and nnodes - 1 = {plan.nnodes - 1}")
    job_dir = Path(args.job_dir).resolve()
    dirs = {"model": Path(args.model_dir or job_dir / "model").resolve(),
            "output": Path(args.output_data_dir or job_dir / "output" / "data").resolve(),
            "logs": job_dir / "output" / "rank-logs"}
    channels = {name: str(Path(path).resolve()) for name, path in parse_pairs(args.channel, "--channel", "NAME=PATH").items()}
    hosts = hosts or (["algo-1"] if nnodes == 1 else [f"algo-{i + 1}" for i in range(nnodes)])
    sm = {"SM_MODEL_DIR": str(dirs["model"]), "SM_OUTPUT_DATA_DIR": str(dirs["output"]),
          "SM_OUTPUT_DIR": str(dirs["output"].parent), "SM_CHANNELS": json.dumps(sorted(channels)),
          **{f"SM_CHANNEL_{_env_name(n)}": p for n, p in channels.items()},
          "SM_HPS": json.dumps(hps, sort_keys=True),
          **{f"SM_HP_{_env_name(k)}": v if isinstance(v, str) else json.dumps(v) for k, v in hps.items()},
          "SM_USER_ARGS": json.dumps(hp_args), "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[node_rank],
          "SM_NUM_CPUS": str(os.cpu_count() or 1), "SM_USER_ENTRY_POINT": Path(script).name,
          "SM_MODULE_DIR": str(Path(script).resolve().parent)}
    sm.update(plan.env)  # SM_HP_MP_PARAMETERS (compact JSON), SM_FRAMEWORK_PARAMS, SM_NUM_GPUS, DS_ACCELERATOR
    sm["SM_TRAINING_ENV"] = json.dumps({
        "channel_input_dirs": channels, "current_host": sm["SM_CURRENT_HOST"], "hosts": hosts, "hyperparameters": hps,
        "model_dir": sm["SM_MODEL_DIR"], "output_data_dir": sm["SM_OUTPUT_DATA_DIR"], "output_dir": sm["SM_OUTPUT_DIR"],
        "num_gpus": int(sm["SM_NUM_GPUS"]), "num_cpus": int(sm["SM_NUM_CPUS"]), "user_entry_point": Path(script).name,
        "additional_framework_parameters": json.loads(sm["SM_FRAMEWORK_PARAMS"])}, sort_keys=True)
    root = Path(__file__).resolve().parents[2]  # the directory holding smp_adapter/ and smdistributed/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    front = [str(root)] if root.name not in ("site-packages", "dist-packages") else []  # smp_adapter without pip install
    if os.environ.get(APEX_FALLBACK) != "0":  # apex's names for the script from its first line (compat/apex_fallback/)
        front.append(APEX_FALLBACK_BOOT)
    if front:
        sm["PYTHONPATH"] = os.pathsep.join([*front, *(p for p in paths if p not in front)])
    sm["PYTHONUNBUFFERED"] = "1"
    if args.comm_ledger:
        sm["SMP_ADAPTER_COMM_LEDGER"] = str(Path(args.comm_ledger).resolve())
    if cpu and "OMP_NUM_THREADS" not in os.environ:  # torch's default (all cores per rank) oversubscribes
        sm["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // plan.nprocs_per_node))
    if args.device == "cpu":
        sm["CUDA_VISIBLE_DEVICES"] = ""
    if cpu and os.environ.get(CUDA_ON_CPU) != "0":  # an unchanged GPU script runs on CPU ranks (compat/cuda_on_cpu.py)
        sm[CUDA_ON_CPU] = "1"
    deepspeed_env = None
    if launcher == "deepspeed" and plan.nnodes > 1:  # pdsh forwards only what this file lists (launch/env_bundle.py)
        deepspeed_env = deepspeed_env_file(sm)
        sm["DS_ENV_FILE"] = str(job_dir / "deepspeed_env")
    command = list(plan.command)
    tail = len(hp_args) + len(script_args) + 1  # the script and its arguments end every command
    head, rest = command[:-tail], command[-tail:]
    if launcher == "deepspeed":
        head = [sys.executable, "-m", LAUNCHER_MODULES[launcher], *head[1:], "--enable_each_rank_log", str(dirs["logs"])]
    elif launcher == "torchrun":
        head = [sys.executable, "-m", LAUNCHER_MODULES[launcher], *head[1:], "--tee", "3", "--log-dir", str(dirs["logs"])]
    elif launcher == "mpirun":  # it exports only what -x names (plan.env is named already); the interpreter ends head
        extra = [t for name in sm if name not in plan.env for t in ("-x", name)]
        head = [launcher_program("mpirun", required=not args.dry_run), *head[1:-1], *extra, head[-1]]
    else:  # srun: --export=ALL hands the ranks this environment
        head = [launcher_program("srun", required=not args.dry_run), *head[1:]]
    heartbeat = None
    if launcher == "torchrun" and plan.nnodes > 1:  # every node has its own launch: they watch each other
        from smp_adapter.launch.node_heartbeat import timeout_from

        master_port = port if port is not None else (cfg.ddp_port or DEFAULT_MASTER_PORT)
        hb_port = args.node_heartbeat_port or master_port + 1
        node_timeout = timeout_from(args.node_timeout)
        if not (0 < hb_port < 65536 and node_timeout > 0):
            raise SMPAdapterError(f"--node-heartbeat-port {hb_port} / --node-timeout {node_timeout:g}: give a TCP port "
                                  "(1-65535) and a positive number of seconds")
        heartbeat = {"node_rank": node_rank, "nnodes": plan.nnodes, "master_addr": args.master_addr, "port": hb_port,
                     "timeout": node_timeout, "job_key": f"{plan.nnodes}:{master_port}"}
    return {"command": [*head, *rest], "set": sm, "plan": plan, "dirs": dirs, "launcher": launcher, "cpu": cpu,
            "rank_offset": node_rank * plan.nprocs_per_node, "channels": channels, "deepspeed_env": deepspeed_env,
            "heartbeat": heartbeat, "notes": [options_source, *notes, *plan.notes]}


def _sdp_engine_note(cfg, world_size: int) -> str | None:
    """Which engine runs sharded_data_parallel_degree < rdp (ParallelDims.engine), and how to pick the other."""
    from smp_adapter.config.dims import SDP_ENGINE_ENV, ParallelDims, sdp_engine_from

    dims = ParallelDims.from_config(cfg, world_size, sdp_engine_from(os.environ))
    if dims.pp > 1 or not 1 < dims.sdp < dims.rdp:
        return None
    if dims.engine == "mics":
        return (f"sharded_data_parallel_degree {dims.sdp} < rdp {dims.rdp}: smp v1's MiCS on torch FSDP2 (groups of "
                f"{dims.sdp} ranks shard everything); {SDP_ENGINE_ENV}=hpz runs DeepSpeed ZeRO-3 + hpZ instead")
    return (f"sharded_data_parallel_degree {dims.sdp} < rdp {dims.rdp}: DeepSpeed ZeRO-3 + hpZ ({SDP_ENGINE_ENV}=hpz); "
            f"unset it for smp v1's MiCS on torch FSDP2")


_CHECKPOINT_HP = re.compile(r"checkpoint.*(dir|path)", re.I)  # checkpoint_dir, checkpoint-dir, checkpoint_path


def _check_storage(b: dict[str, Any]) -> None:
    """Before any rank starts: the job's directories, and the checkpoint directory a hyperparameter names,
    can be written and are not full (found hours in at the first save otherwise, or as empty rank logs)."""
    from smp_adapter.runtime.checkpoint.storage import writable_problem

    hps = json.loads(b["set"]["SM_HPS"])
    places = {f"{name} directory": d for name, d in b["dirs"].items()}
    places.update({f"hyperparameter {k} (checkpoint directory)": Path(v).resolve() for k, v in hps.items()
                   if _CHECKPOINT_HP.search(k) and isinstance(v, str) and v and "://" not in v})
    problems = [f"{what} {d} {problem}" for what, d in places.items() if (problem := writable_problem(d))]
    if problems:
        raise SMPAdapterError("; ".join(problems) + ": free space there or give other directories (--job-dir, "
                              "--model-dir, --output-data-dir, the checkpoint hyperparameter)")


def run(args: argparse.Namespace) -> int:
    b = build(args)
    plan = b["plan"]
    summary = (f"{plan.nnodes} node(s) x {plan.nprocs_per_node} processes, launcher {b['launcher']}, "
               f"{'CPU (gloo)' if b['cpu'] else 'GPU'}")
    if args.dry_run:
        print(f"# smp-adapter launch: {summary}")
        print("# environment set for the job (on top of the current one):")
        for name, value in b["set"].items():
            print(f"export {name}={shlex.quote(value)}")
        print(shlex.join(b["command"]))
        if b["deepspeed_env"]:
            print(f"# written at launch to {b['set']['DS_ENV_FILE']} (DS_ENV_FILE), for the ranks on other hosts:")
            for line in b["deepspeed_env"].splitlines():
                print(f"#   {line}")
        for note in b["notes"]:
            print(f"# note: {note}")
        return 0
    for name, path in b["channels"].items():
        if not Path(path).exists():
            raise SMPAdapterError(f"--channel {name}={path}: the directory does not exist")
    try:
        for d in b["dirs"].values():
            d.mkdir(parents=True, exist_ok=True)
        if b["deepspeed_env"]:
            Path(b["set"]["DS_ENV_FILE"]).write_text(b["deepspeed_env"])
    except OSError as exc:
        raise SMPAdapterError(f"cannot create {exc.filename} ({exc.strerror}): give writable --job-dir/--model-dir") from None
    _check_storage(b)
    for note in b["notes"]:
        print(f"smp-adapter launch: note: {note}", file=sys.stderr)
    print(f"smp-adapter launch: {summary}; rank logs in {b['dirs']['logs']}", file=sys.stderr, flush=True)
    if b["set"].get(CUDA_ON_CPU) == "1":
        print("smp-adapter launch: CUDA on CPU ranks: the script's torch.cuda calls and 'cuda' devices run on the CPU, "
              f"one simulated GPU per rank (docs/launch.md; {CUDA_ON_CPU}=0 turns it off)", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith("OMPI_COMM_WORLD")}
    env.update(b["set"])
    from smp_adapter.launch.rank_watch import ENV as LAUNCH_PROCESS, identity
    from smp_adapter.launch.supervisor import Supervisor

    me = identity()  # the ranks end when this process dies, even by SIGKILL (launch/rank_watch.py); not in --dry-run's
    if me:           # exports: it names this process
        env[LAUNCH_PROCESS] = me
    heartbeat = None
    if b["heartbeat"]:
        from smp_adapter.launch.node_heartbeat import NodeHeartbeat

        heartbeat = NodeHeartbeat(**b["heartbeat"])
        try:
            heartbeat.listen()
        except OSError as exc:
            raise SMPAdapterError(f"node 0 cannot listen for the other nodes' heartbeats on port {heartbeat.port} "
                                  f"({exc.strerror or exc}): give a free port with --node-heartbeat-port") from None
        print(f"smp-adapter launch: node {heartbeat.node_rank}: heartbeats with the other nodes' launch processes "
              f"(port {heartbeat.port} on node 0); a node silent for {heartbeat.timeout:g} s ends the job "
              "(--node-timeout)", file=sys.stderr, flush=True)
    sup = Supervisor(b["command"], env, b["launcher"], rank_offset=b["rank_offset"],
                     rank_log_dir=b["dirs"]["logs"] if b["launcher"] == "deepspeed" else None,
                     timeout=args.timeout, grace=args.grace, heartbeat=heartbeat)
    return sup.run()
