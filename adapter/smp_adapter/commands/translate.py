"""``smp-adapter translate INPUT``: show what a SageMaker smp job becomes, and which engine runs it.

INPUT is a JSON/YAML file or inline JSON holding plain smp options, a SageMaker distribution dict
(optionally with instance_count), or a file with an ``smp_options:`` section. Prints the DeepSpeed
config, the Megatron-core settings with the equivalent Megatron-LM arguments, and the deepspeed,
torchrun and mpirun launch commands with their environment; ``--explain`` adds the mapping table.
For a distribution dict it also prints the mpirun line SageMaker's training toolkit builds for it
(what runs inside a SageMaker job or a container started like one, docs/launch.md); text output only.
``--format json`` prints the same as one JSON document (the format of configs/golden/*.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from smp_adapter.config.dims import ParallelDims, sdp_engine_from
from smp_adapter.config.distribution import JobSpec, load_job
from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.errors import SMPAdapterError
from smp_adapter.translate.deepspeed import to_deepspeed_config
from smp_adapter.translate.explain import ExplainRow, explain, format_table
from smp_adapter.launch.command import DEFAULT_MASTER_PORT, job_config, resolve_processes, to_launch_plan
from smp_adapter.launch.launchers import LAUNCHERS, launcher_named
from smp_adapter.translate.kernels import compile_setting_from
from smp_adapter.translate.megatron import to_megatron_plan
from smp_adapter.translate.mics import mics_settings
from smp_adapter.launch.sagemaker_toolkit import SAGEMAKER_TOOLKIT, TOOLKIT

NAME = "translate"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="translate smp options to engine settings (DeepSpeed, Megatron) and launch commands; --explain names the engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="INPUT", help="JSON/YAML file or inline JSON ('{\"ddp\": true, ...}')")
    procs = p.add_mutually_exclusive_group()
    procs.add_argument("--world-size", type=int, metavar="N",
                       help="total processes (default: instance_count x processes_per_host of a distribution dict, "
                            "else pipeline x tensor x sharded-data-parallel degree)")
    # the names `launch` takes; SageMaker's names stay as aliases
    procs.add_argument("--nproc-per-node", "--processes-per-host", dest="processes_per_host", type=int, metavar="N",
                       help="processes per node (mpi.processes_per_host); alias --processes-per-host")
    p.add_argument("--nnodes", "--instance-count", dest="instance_count", type=int, metavar="K",
                   help="number of nodes (instance_count); alias --instance-count")
    p.add_argument("--batch-size", type=int, metavar="B",
                   help="per-rank batch passed to smp.step (default: microbatches, one sample per microbatch)")
    p.add_argument("--script", default="train.py", help="training script in the launch commands (default: train.py)")
    p.add_argument("--master-port", type=int, metavar="P",
                   help=f"rendezvous port (default: ddp_port, else {DEFAULT_MASTER_PORT})")
    p.add_argument("--cpu", action="store_true", help="launch commands for CPU processes (DS_ACCELERATOR=cpu, gloo)")
    p.add_argument("--instance-type", default="ml.p3.16xlarge", metavar="TYPE",
                   help="SageMaker instance type for the toolkit's mpirun line (EFA flags; default: ml.p3.16xlarge)")
    p.add_argument("--explain", action="store_true", help="print the smp -> engine mapping table")
    p.add_argument("--out", metavar="DIR", help="write deepspeed_config.json (mics.json at sdp < rdp on MiCS), megatron.json, launch.json "
                                                   "(+ explain.txt)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    return p


def translation_bundle(job: JobSpec, world_size: int | None = None, instance_count: int | None = None,
                       processes_per_host: int | None = None, batch_size: int | None = None,
                       script: str = "train.py", master_port: int | None = None, cpu: bool = False) -> dict[str, Any]:
    """Everything ``translate`` shows, as JSON-ready data (also what configs/golden/*.json hold)."""
    cfg = job_config(job, world_size, processes_per_host, instance_count)  # bad options: every problem at once
    if world_size is not None:
        nnodes = job.instance_count if instance_count is None else instance_count
        if not isinstance(nnodes, int) or nnodes < 1 or world_size % nnodes:
            raise_if_any([ConfigProblem("--world-size", f"must be a multiple of the instance count ({nnodes})",
                                        "give a world size that splits evenly over the instances", world_size)])
        nprocs = world_size // nnodes
    else:
        nnodes, nprocs = resolve_processes(job, cfg, processes_per_host, instance_count)
    dims = ParallelDims.from_config(cfg, nnodes * nprocs, sdp_engine_from(os.environ))
    ds = to_deepspeed_config(dims, batch_size)  # explain's rows read it; shown only where DeepSpeed runs
    plan = to_megatron_plan(dims, batch_size)
    launch = {name: to_launch_plan(job, cfg, script, launcher=name, nprocs_per_node=nprocs, nnodes=nnodes,
                                   master_port=master_port, cpu=cpu, dims=dims).to_dict() for name in LAUNCHERS}
    return {
        "world_size": dims.world_size,
        "nnodes": nnodes,
        "nprocs_per_node": nprocs,
        "per_rank_batch": cfg.microbatches if batch_size is None else batch_size,
        "smp_options": dict(job.options),
        "effective_options": cfg.to_dict(),
        "warnings": list(cfg.warnings),
        "deepspeed": None if dims.mics_group_size > 1 else ds,
        "mics": mics_settings(dims) if dims.mics_group_size > 1 else None,
        "megatron": {**plan.to_dict(), "megatron_lm_args": plan.to_megatron_lm_args(),
                     "megatron_lm_note": plan.megatron_lm_note()},
        "launch": launch,
        "explain": [row.to_dict() for row in explain(job, dims, ds, plan, compile_setting_from(os.environ))],
    }


def _shell(plan: dict[str, Any]) -> str:
    return launcher_named(plan["launcher"]).shell(plan["env"], plan["command"])


def _megatron_text(mg: dict[str, Any]) -> str:
    skip = {"megatron_lm_args", "megatron_lm_note"}
    lines = [f"  {k}: {json.dumps(v)}" for k, v in mg.items() if k not in skip]
    lines.append("Megatron-LM arguments: " + " ".join(mg["megatron_lm_args"]))
    if mg["megatron_lm_note"]:
        lines.append(f"  note: {mg['megatron_lm_note']}")
    return "\n".join(lines)


def sagemaker_toolkit_section(job: JobSpec, bundle: dict[str, Any], script: str,
                              instance_type: str = "ml.p3.16xlarge") -> dict[str, Any] | None:
    """The toolkit's mpirun line for a distribution dict (None for plain options: SageMaker needs the
    dict). Shown beside the launch commands; not part of the golden bundle."""
    if job.source != "distribution":
        return None
    cmd = SAGEMAKER_TOOLKIT.command(job, script, bundle["nprocs_per_node"],
                                    hosts=[f"algo-{i + 1}" for i in range(bundle["nnodes"])], instance_type=instance_type)
    return {"toolkit": TOOLKIT, "command": list(cmd.command), "notes": list(cmd.notes)}


def _engine_text(bundle: dict[str, Any]) -> list[str]:
    """The sharding engine's settings: DeepSpeed's config, or at sdp < rdp what the MiCS engine is given."""
    if bundle["mics"] is not None:
        return ["MiCS engine settings (torch FSDP2; no DeepSpeed config is used at this layout):",
                json.dumps(bundle["mics"], indent=2)]
    return ["DeepSpeed config:", json.dumps(bundle["deepspeed"], indent=2)]


def _text(bundle: dict[str, Any], table: str | None, layout: str | None = None) -> str:
    parts = [f"# world size {bundle['world_size']} = {bundle['nnodes']} node(s) x {bundle['nprocs_per_node']} processes, "
             f"per-rank batch {bundle['per_rank_batch']}",
             "", *_engine_text(bundle), "", "Megatron-core settings:", _megatron_text(bundle["megatron"])]
    for name, plan in bundle["launch"].items():
        parts += ["", f"Launch with {name}:", "  " + _shell(plan)]
        parts += [f"  note: {note}" for note in plan["notes"]]
    toolkit = bundle.get("sagemaker_toolkit")
    if toolkit:
        parts += ["", f"SageMaker training toolkit ({toolkit['toolkit']}) runs, on the first host:",
                  "  " + SAGEMAKER_TOOLKIT.shell({}, toolkit["command"])]
        parts += [f"  note: {note}" for note in toolkit["notes"]]
    if table is not None:
        parts += ["", f"Layout: {layout}", "", "Mapping (smp -> engines):", table]
    return "\n".join(parts)


def _write_outputs(out: str, bundle: dict[str, Any], table: str | None) -> list[Path]:
    directory = Path(out)
    engine_file = ("mics.json", bundle["mics"]) if bundle["mics"] is not None else ("deepspeed_config.json",
                                                                                     bundle["deepspeed"])
    files = {engine_file[0]: json.dumps(engine_file[1], indent=2) + "\n",
             "megatron.json": json.dumps(bundle["megatron"], indent=2) + "\n",
             "launch.json": json.dumps(bundle["launch"], indent=2) + "\n"}
    if table is not None:
        files["explain.txt"] = table + "\n"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    except OSError as exc:
        raise SMPAdapterError(f"--out {out}: cannot write ({exc.strerror or exc}); give a writable directory") from None
    return [directory / name for name in files]


def run(args: argparse.Namespace) -> int:
    job = load_job(args.input)
    bundle = translation_bundle(job, world_size=args.world_size, instance_count=args.instance_count,
                                processes_per_host=args.processes_per_host, batch_size=args.batch_size,
                                script=args.script, master_port=args.master_port, cpu=args.cpu)
    for warning in bundle["warnings"]:
        print(f"smp-adapter: warning: {warning}", file=sys.stderr)
    table = None
    layout = None
    if args.explain:
        table = format_table([ExplainRow(**row) for row in bundle["explain"]])
        # the layout line plan prints too (one model of a layout: ParallelDims.describe)
        layout = ParallelDims.from_config(job.config(), bundle["world_size"], sdp_engine_from(os.environ)).describe()
    if args.format == "json":
        print(json.dumps(bundle, indent=2))
    else:  # the toolkit's line and the layout line are text only: --format json and --out keep the golden
        # bundle's content
        toolkit = sagemaker_toolkit_section(job, bundle, args.script, args.instance_type)
        print(_text({**bundle, "sagemaker_toolkit": toolkit} if toolkit else bundle, table, layout))
    if args.out:
        for path in _write_outputs(args.out, bundle, table):
            print(f"wrote {path}", file=sys.stderr)
    return 0
