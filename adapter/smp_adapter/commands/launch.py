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
import json
import os
import re
import sys
from pathlib import Path

from smp_adapter.errors import SMPAdapterError
from smp_adapter.launch.job import CUDA_ON_CPU, SCRUB, LaunchJob, build
from smp_adapter.launch.launchers import LAUNCHERS

NAME = "launch"


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


def _script_options(script: str) -> dict:
    """The options the script gives smp.init, read statically; launch-time options are checked merged
    with them. Unknown (no smp.init call found, or not a literal dict): assume ddp, smp.init checks."""
    from smp_adapter.check.script import script_options

    try:  # options only: the full check reads the runtime's classes, which imports torch (~1 s)
        options = script_options(Path(script).read_text(), script)
    except (SyntaxError, ValueError, OSError, SMPAdapterError):
        options = None
    return {"ddp": True} if options is None else options


_CHECKPOINT_HP = re.compile(r"checkpoint.*(dir|path)", re.I)  # checkpoint_dir, checkpoint-dir, checkpoint_path


def _check_storage(job: LaunchJob) -> None:
    """Before any rank starts: the job's directories, and the checkpoint directory a hyperparameter names,
    can be written and are not full (found hours in at the first save otherwise, or as empty rank logs)."""
    from smp_adapter.runtime.checkpoint.storage import writable_problem

    hps = json.loads(job.env["SM_HPS"])
    places = {f"{name} directory": d for name, d in job.dirs.items()}
    places.update({f"hyperparameter {k} (checkpoint directory)": Path(v).resolve() for k, v in hps.items()
                   if _CHECKPOINT_HP.search(k) and isinstance(v, str) and v and "://" not in v})
    problems = [f"{what} {d} {problem}" for what, d in places.items() if (problem := writable_problem(d))]
    if problems:
        raise SMPAdapterError("; ".join(problems) + ": free space there or give other directories (--job-dir, "
                              "--model-dir, --output-data-dir, the checkpoint hyperparameter)")


def run(args: argparse.Namespace) -> int:
    job = build(args, _script_options)  # the static script check sits above launch/: handed in
    if args.dry_run:
        print(job.dry_run_text(), end="")
        return 0
    for name, path in job.channels.items():
        if not Path(path).exists():
            raise SMPAdapterError(f"--channel {name}={path}: the directory does not exist")
    try:
        for d in job.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        if job.deepspeed_env:
            Path(job.env["DS_ENV_FILE"]).write_text(job.deepspeed_env)
    except OSError as exc:
        raise SMPAdapterError(f"cannot create {exc.filename} ({exc.strerror}): give writable --job-dir/--model-dir") from None
    _check_storage(job)
    for note in job.notes:
        print(f"smp-adapter launch: note: {note}", file=sys.stderr)
    print(f"smp-adapter launch: {job.summary}; rank logs in {job.dirs['logs']}", file=sys.stderr, flush=True)
    if job.env.get(CUDA_ON_CPU) == "1":
        print("smp-adapter launch: CUDA on CPU ranks: the script's torch.cuda calls and 'cuda' devices run on the CPU, "
              f"one simulated GPU per rank (docs/launch.md; {CUDA_ON_CPU}=0 turns it off)", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith("OMPI_COMM_WORLD")}
    env.update(job.env)
    from smp_adapter.launch.rank_watch import ENV as LAUNCH_PROCESS, identity
    from smp_adapter.launch.supervisor import Supervisor

    me = identity()  # the ranks end when this process dies, even by SIGKILL (launch/rank_watch.py); not in --dry-run's
    if me:           # exports: it names this process
        env[LAUNCH_PROCESS] = me
    heartbeat = _heartbeat(job) if job.heartbeat else None
    sup = Supervisor(job.command, env, job.launcher.name, rank_offset=job.rank_offset,
                     rank_log_dir=job.dirs["logs"] if job.launcher.tails_rank_logs else None,
                     timeout=args.timeout, grace=args.grace, heartbeat=heartbeat, cause_dir=job.dirs["causes"])
    return sup.run()


def _heartbeat(job: LaunchJob):
    """This node's heartbeat with the other nodes' launch processes, listening on node 0."""
    from smp_adapter.launch.node_heartbeat import NodeHeartbeat

    heartbeat = NodeHeartbeat(**job.heartbeat)
    try:
        heartbeat.listen()
    except OSError as exc:
        raise SMPAdapterError(f"node 0 cannot listen for the other nodes' heartbeats on port {heartbeat.port} "
                              f"({exc.strerror or exc}): give a free port with --node-heartbeat-port") from None
    print(f"smp-adapter launch: node {heartbeat.node_rank}: heartbeats with the other nodes' launch processes "
          f"(port {heartbeat.port} on node 0); a node silent for {heartbeat.timeout:g} s ends the job "
          "(--node-timeout)", file=sys.stderr, flush=True)
    return heartbeat
