"""``smp-adapter plan OPTIONS --model CONFIG``: memory, communication and step time of a layout on a
cluster, before launching (docs/plan.md). The formulas are plan/costs.py and plan/timing.py; the
layout rules are the config layer's (ParallelDims); ``--search`` holds the job (model, cluster,
global batch) fixed and ranks every layout that realises it within usable memory minus a headroom.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from smp_adapter.plan.input_errors import PlanInputError

NAME = "plan"
GiB, GB = 2**30, 10**9
HARDWARE_FLAGS = ("gpus_per_node", "gpu_memory", "intra_node_bandwidth", "inter_node_bandwidth", "gpu_flops")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="predict memory, traffic and step time of a layout on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("options", metavar="OPTIONS", help="smp options, a distribution dict (file or inline JSON)")
    p.add_argument("--model", required=True, metavar="CONFIG",
                   help="Hugging Face config.json, its directory, or a recipe naming one")
    batch = p.add_argument_group("the job's batch (one of them; --search needs the global batch or --batch-size)")
    batch.add_argument("--batch-size", type=int, metavar="B", help="samples per data-parallel rank per smp.step call")
    batch.add_argument("--global-batch", type=int, metavar="N", help="samples per optimizer step over the whole job")
    batch.add_argument("--global-batch-tokens", type=int, metavar="T", help="tokens per optimizer step (N x sequence length)")
    p.add_argument("--accumulation", type=int, default=1, metavar="K",
                   help="smp.step calls per optimizer step (DistributedModel backward_passes_per_step; default 1)")
    p.add_argument("--seq-len", type=int, metavar="S", help="sequence length (default: the config's; images: patches + 1)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="every transformer layer checkpointed (--search: fixed on instead of searched)")
    p.add_argument("--script", metavar="train.py",
                   help="read activation checkpointing and delayed parameter initialisation from the script")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="the optimizer's state per parameter: adam (two fp32 moments, default) or sgd (none)")
    where = p.add_argument_group("the hardware (one of --instance-type, --node, --cluster, or the five figures below)")
    where.add_argument("--instance-type", metavar="TYPE",
                       help="a SageMaker instance type, e.g. ml.p4d.24xlarge (docs/plan.md lists them)")
    where.add_argument("--node", metavar="PRESET",
                       help="a common node outside SageMaker: 8xH100-SXM, 8xH200-SXM, 8xA100-SXM-80GB, 8xA100-SXM-40GB "
                            "(NVLink, their DGX NICs), 8xL40S-PCIe, 8xL4-PCIe, 4xL4-PCIe, 4xT4-PCIe (docs/plan.md)")
    where.add_argument("--cluster", metavar="FILE",
                       help="your own nodes in YAML: GPUs per node, GPU, links, NICs (docs/plan.md, 'Your own hardware')")
    where.add_argument("--instance-count", "--nodes", type=int, default=None, metavar="N",
                       help="nodes in the job (default 1, or the --cluster file's)")
    hw = p.add_argument_group("hardware described with figures (instead of the three above; all five needed)")
    hw.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs (ranks) on each node")
    hw.add_argument("--gpu-memory", type=float, metavar="GiB", help="what the framework can allocate per GPU")
    hw.add_argument("--intra-node-bandwidth", type=float, metavar="GB/s",
                    help="between GPUs of a node, per GPU, per direction (NVLink, PCIe)")
    hw.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s",
                    help="of a node's network, all its NICs together, per direction")
    hw.add_argument("--gpu-flops", type=float, metavar="TFLOP/s", help="peak dense FLOP/s at the job's precision")
    p.add_argument("--collectives", choices=("nccl", "gloo"), default="nccl",
                   help="the ranks' collective library: nccl (GPUs, default) or gloo (CPU ranks, fp32; with the "
                        "hardware described: --gpu-flops is a rank's measured fp32 matmul rate; docs/plan.md)")
    p.add_argument("--headroom", type=float, default=10.0, metavar="PERCENT",
                   help="device memory kept free of the plan's peak (default 10; the plan's own error is ~10%%)")
    p.add_argument("--search", action="store_true",
                   help="hold the job fixed and rank every layout that realises its global batch and fits")
    p.add_argument("--cross-node-groups", action="store_true",
                   help="--search: also offer tensor-parallel and hpZ groups that span nodes")
    p.add_argument("--top", type=int, default=5, metavar="N", help="layouts shown by --search (default 5)")
    p.add_argument("--explain", action="store_true",
                   help="per phase of the step (forward, backward, last backward, pipeline sends): its compute, "
                        "each link's collectives beside it, and what shows")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def _bad(label, flag, message, fix, *value):
    raise PlanInputError(label, flag, message, fix, *value)


def check_arguments(args) -> None:
    """Every command-line figure, before anything is read: one message each, exit 2."""
    for flag, value in (("--batch-size", args.batch_size), ("--global-batch", args.global_batch),
                        ("--global-batch-tokens", args.global_batch_tokens), ("--accumulation", args.accumulation),
                        ("--instance-count", args.instance_count), ("--top", args.top)):
        if value is not None and value < 1:
            _bad("command line", flag, "must be a positive integer", f"give {flag} 1 or more", value)
    if args.global_batch is not None and args.global_batch_tokens is not None:
        _bad("command line", "--global-batch-tokens", "cannot be combined with --global-batch (both set the global batch)",
             "give one of them", args.global_batch_tokens)
    if args.batch_size is None and args.global_batch is None and args.global_batch_tokens is None:
        _bad("command line", "--batch-size", "is missing: plan needs the job's batch",
             "give --batch-size B (samples per rank per smp.step call) or --global-batch N / --global-batch-tokens T")
    if not 0 <= args.headroom < 90:
        _bad("command line", "--headroom", "must be a percentage from 0 to 90", "e.g. --headroom 10", args.headroom)
    given = [f"--{f.replace('_', '-')}" for f in HARDWARE_FLAGS if getattr(args, f) is not None]
    named = [(flag, value) for flag, value in (("--instance-type", args.instance_type), ("--node", args.node),
                                               ("--cluster", args.cluster)) if value is not None]
    if len(named) > 1:
        _bad("hardware", named[1][0], f"cannot be combined with {named[0][0]} (both describe the hardware)",
             "give one of --instance-type, --node, --cluster", named[1][1])
    if named and given:
        _bad("hardware", given[0], f"cannot be combined with {named[0][0]} ({', '.join(given)} would be ignored)",
             f"give {named[0][0]}, or describe the hardware with all of --gpus-per-node --gpu-memory "
             "--intra-node-bandwidth --inter-node-bandwidth --gpu-flops, not both", named[0][1])


def cluster_from_args(args):
    from smp_adapter.plan.cluster_file import read_cluster_file
    from smp_adapter.plan.instances import GB as _GB, NCCL_LATENCY, Cluster, instance_cluster, intra_node_link, node_cluster

    collectives = args.collectives
    if args.cluster:  # the file says its collectives; --collectives gloo on the command line still wins
        cluster = read_cluster_file(args.cluster, args.instance_count)
        return dataclasses.replace(cluster, collectives="gloo") if collectives == "gloo" else cluster
    count = 1 if args.instance_count is None else args.instance_count
    if args.instance_type or args.node:
        table = instance_cluster(args.instance_type, count) if args.instance_type else node_cluster(args.node, count)
        return dataclasses.replace(table, collectives=collectives)
    explicit = [getattr(args, f) for f in HARDWARE_FLAGS]
    if any(v is None for v in explicit):
        _bad("hardware", "--instance-type", "is missing and the hardware is not fully described",
             "give --instance-type ml.p4d.24xlarge --instance-count N, --node 8xH100-SXM --nodes N, --cluster FILE, "
             "or all of --gpus-per-node --gpu-memory --intra-node-bandwidth --inter-node-bandwidth --gpu-flops")
    for flag, value in zip(HARDWARE_FLAGS, explicit):
        if value <= 0:
            _bad("hardware", f"--{flag.replace('_', '-')}", "must be positive", "give a positive number", value)
    flops = args.gpu_flops * 1e12
    nccl = collectives == "nccl"  # gloo's per-call cost is inside its measured efficiency (plan/timing.py)
    latency = ({"call_latency": NCCL_LATENCY["call"], "intra_node_latency":
                NCCL_LATENCY[intra_node_link(args.intra_node_bandwidth * _GB)], "inter_node_latency": NCCL_LATENCY["net"]}
               if nccl else {})
    return Cluster("custom", args.gpus_per_node, count, int(args.gpu_memory * GiB),
                   {"fp32": flops, "fp16": flops, "bf16": flops}, args.intra_node_bandwidth * _GB,
                   args.inter_node_bandwidth * _GB, collectives=collectives,
                   gpu="" if nccl else "cpu", **latency)  # the compute-efficiency table's key for CPU ranks


def read_options(text: str):
    """The OPTIONS argument: a file that cannot be read or parsed is a file problem, not an smp one."""
    from smp_adapter.config.distribution import load_job, parse_inline_or_file
    from smp_adapter.errors import SMPConfigError

    try:
        parse_inline_or_file(text)
    except SMPConfigError as exc:
        first = exc.problems[0]
        label = "smp options (inline JSON)" if text.lstrip().startswith("{") else "smp options file"
        raise PlanInputError(label, "OPTIONS", first.message, first.fix, text) from None
    return load_job(text)


def script_features(path: str) -> tuple[bool, bool]:
    """(activation checkpointing, delayed parameter initialisation) the script asks for."""
    from smp_adapter.check.script import check_source

    try:
        source = Path(path).read_text()
    except OSError as exc:
        _bad("training script", "--script", f"cannot be read ({exc.strerror})", "give the training script's path", path)
    except UnicodeDecodeError:
        _bad("training script", "--script", "is not a text file", "give the training script (a .py file)", path)
    try:
        uses = check_source(source, path).uses
    except SyntaxError as exc:
        _bad("training script", "--script", f"is not valid Python ({exc.msg}, line {exc.lineno})",
             "give the training script", path)
    names = {u.name for u in uses}
    return "set_activation_checkpointing" in names, "delay_param_initialization" in names


def run(args) -> int:
    from smp_adapter.config.dims import ParallelDims, sdp_engine_from
    from smp_adapter.config.problems import raise_if_any
    from smp_adapter.plan.layouts import model_problems
    from smp_adapter.plan.model_spec import model_spec

    check_arguments(args)
    job_spec = read_options(args.options)
    cluster = cluster_from_args(args)
    spec = model_spec(args.model, args.seq_len)
    checkpointing, delayed = script_features(args.script) if args.script else (False, False)
    checkpointing = checkpointing or args.activation_checkpointing
    cfg = job_spec.config()
    if args.global_batch_tokens is not None and args.global_batch_tokens % spec.seq_len:
        _bad("command line", "--global-batch-tokens", f"is not a whole number of sequences of {spec.seq_len} tokens",
             f"give a multiple of {spec.seq_len}, or --global-batch in samples", args.global_batch_tokens)
    global_batch = args.global_batch or (args.global_batch_tokens // spec.seq_len if args.global_batch_tokens else None)
    if args.search and global_batch is not None:
        return _search(args, spec, job_spec, cluster, global_batch, checkpointing, delayed)
    dims = ParallelDims.from_config(cfg, cluster.world_size, sdp_engine_from(os.environ))
    if args.search:  # the job as given: its per-rank batch on its own layout
        return _search(args, spec, job_spec, cluster, dims.global_batch_size(args.batch_size) * args.accumulation,
                       checkpointing, delayed)
    raise_if_any(model_problems(spec, dims.tp, dims.pp))
    batch = args.batch_size
    if batch is None:
        replicas = dims.global_batch_size(1) * args.accumulation
        if global_batch % replicas:
            _bad("command line", "--global-batch", f"is not a multiple of this layout's {replicas} replicas x "
                 "accumulation steps", f"give a multiple of {replicas}, or --batch-size", global_batch)
        batch = global_batch // replicas
    elif global_batch is not None and dims.global_batch_size(batch) * args.accumulation != global_batch:
        _bad("command line", "--global-batch", f"disagrees with --batch-size {batch}: this layout trains "
             f"{dims.global_batch_size(batch) * args.accumulation} samples per optimizer step",
             "give one of them", global_batch)
    dims.micro_batch_size(batch)
    from smp_adapter.plan import costs

    job = costs.Job(batch, checkpointing, args.optimizer, args.accumulation, delayed)
    result = _plan(spec, dims, cluster, job)
    headroom = args.headroom / 100
    lines = _notices(result, dims, cluster)
    if args.json:
        print(json.dumps({"layout": _layout(dims, job), "cluster": _cluster_dict(cluster), "model": _model_dict(spec),
                          "activation_checkpointing": checkpointing, **_summary(result, cluster, headroom),
                          "notices": lines}, indent=1))
    else:
        print(_text(spec, dims, cluster, job, result, headroom, lines))
        if args.explain:
            print("\n" + _explain(result, cluster))
    return 0


def _plan(spec, dims, cluster, job):
    from smp_adapter.plan import costs

    try:
        return costs.plan(spec, dims, cluster, job)
    except ValueError as exc:  # the precision the GPU lacks (T4, V100: bf16)
        raise PlanInputError("precision", "bf16" if dims.cfg.bf16 else "fp16", str(exc),
                             "use fp16 on this GPU (or fp32)", True) from None


def _notices(result, dims, cluster) -> list[str]:
    from smp_adapter.plan import costs
    from smp_adapter.plan.notices import notices

    return notices(result, dims, cluster, costs.precision(dims.cfg))


def _layout(dims, job=None) -> dict:
    cfg = dims.cfg
    out = {"pipeline_parallel_degree": dims.pp, "tensor_parallel_degree": dims.tp, "rdp": dims.rdp,
           "sharded_data_parallel_degree": dims.sdp, "engine": dims.engine, "sdp_engine_setting": _setting(dims),
           "zero_stage": dims.zero_stage, "mics_group_size": dims.mics_group_size,
           "hpz_partition_size": dims.hpz_partition_size, "prescaled_batch": cfg.prescaled_batch,
           "microbatches": cfg.microbatches}
    if dims.pp > 1:
        out.update(pipeline=cfg.pipeline, virtual_pipeline_degree=cfg.virtual_pipeline_degree)
    if job is not None:
        out.update(batch_per_rank=job.batch, microbatch_size=job.batch // cfg.microbatches,
                   accumulation=job.accumulation, activation_checkpointing=job.activation_checkpointing)
    return out


def _setting(dims) -> dict:
    """The adapter setting that selects this layout's engine: {SMP_ADAPTER_SDP_ENGINE: mics|hpz} for
    1 < sdp < rdp at pp 1 (mics, the default, needs none), else {} (the layout decides)."""
    from smp_adapter.config.dims import SDP_ENGINE_ENV

    if dims.chooses_sdp_engine:
        return {SDP_ENGINE_ENV: dims.sdp_engine}
    return {}


def _engine_line(dims) -> str:
    """Which engine runs the layout, and for 1 < sdp < rdp how to choose the other one."""
    from smp_adapter.config.dims import SDP_ENGINE_ENV

    name = {"mics": "mics (smp v1's MiCS on torch FSDP2)", "deepspeed": "deepspeed (DeepSpeed ZeRO)",
            "pipeline": "pipeline (torch.distributed.pipelining)"}.get(dims.engine, dims.engine)
    if not _setting(dims):
        return f"engine: {name}"
    if dims.engine == "mics":
        return (f"engine: {name}, the default for sharded_data_parallel_degree < rdp; {SDP_ENGINE_ENV}=hpz runs the "
                "layout on DeepSpeed ZeRO-3 + hpZ instead")
    return (f"engine: DeepSpeed ZeRO-3 + hpZ ({SDP_ENGINE_ENV}=hpz); unset it (or {SDP_ENGINE_ENV}=mics) for smp v1's "
            "MiCS on torch FSDP2, the default")


def _cluster_dict(c) -> dict:
    return {"name": c.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu,
            "gpu_memory_bytes": c.gpu_memory, "usable_memory_bytes": c.allocatable, "host_memory_bytes": c.host_memory,
            "intra_node_bandwidth": c.intra_node_bandwidth, "inter_node_bandwidth": c.inter_node_bandwidth,
            "collectives": c.collectives}


def _model_dict(spec) -> dict:
    return {"family": spec.family, "parameters": spec.total_params, "layers": spec.layers, "hidden": spec.hidden,
            "seq_len": spec.seq_len}


def comm_by_group(result) -> dict:
    out: dict = {}
    for term in result.comm:
        entry = out.setdefault(term.group, {"intra_node_bytes": 0, "inter_node_bytes": 0, "ops": {}})
        entry["intra_node_bytes" if term.intra_node else "inter_node_bytes"] += int(term.bytes)
        op = entry["ops"].setdefault(term.op, {"bytes": 0, "calls": 0, "overlapped_bytes": 0})
        op["bytes"] += int(term.bytes)
        op["calls"] += int(term.calls)
        op["overlapped_bytes"] += int(term.bytes) if term.overlap else 0
    return out


def link_bytes(result, cluster) -> float:
    """Bytes one node sends over its network link per optimizer step (timing.link_bytes_per_node)."""
    from smp_adapter.plan import timing

    return sum(timing.link_bytes_per_node(term, cluster) for term in result.comm)


def _budget(cluster, headroom) -> int:
    return int(cluster.allocatable * (1 - headroom))


def _summary(result, cluster, headroom) -> dict:
    budget = _budget(cluster, headroom)
    return {"fits": result.peak_bytes <= budget, "peak_memory_bytes": int(result.peak_bytes),
            "usable_memory_bytes": cluster.allocatable, "headroom": headroom, "memory_left_bytes": budget - result.peak_bytes,
            "memory_breakdown": {k: int(v) for k, v in result.memory.items()},
            "host_memory_per_rank_bytes": result.host,
            "comm_bytes_per_step": comm_by_group(result), "link_bytes_per_node_per_step": link_bytes(result, cluster),
            "step_time_s": result.step_time_s,
            "global_batch": result.samples, "samples_per_s": result.samples_per_s,
            "tokens_per_s_per_gpu": result.tokens_per_s_per_gpu, "mfu": result.mfu,
            "compute_efficiency": result.efficiency, "compute_efficiency_calibrated": result.efficiency_calibrated,
            "compute_s": result.compute_s, "comm_s": result.comm_s, "exposed_comm_s": result.exposed_comm_s,
            "bubble_s": result.bubble_s, "pipeline_overhead_s": result.overhead_s, "phases": _phases(result, cluster)}


def _phases(result, cluster) -> dict:
    """Per overlap window: its compute, each link's collectives beside it, and what shows; and the
    collectives on the critical path (timing.phases)."""
    from smp_adapter.plan import timing

    windows, critical = timing.phases(result.comm, cluster, result.compute_s, result.microbatches, result.passes)
    out = {p.name: {"compute_s": p.window_s, "comm_s_by_link": dict(p.links), "exposed_s": p.exposed_s} for p in windows}
    out["critical_path"] = {"exposed_s": critical}
    return out


# what each window is, for --explain (plan/timing.py's phases)
PHASE_TEXT = {"forward": "the forwards (gathers prefetched one layer ahead)",
              "backward": "recompute + backward of every microbatch but the last (re-gathers, reduce-scatters)",
              "last_backward": "the last microbatch's recompute + backward (its share of the backward traffic, and "
                               "the reductions backward hooks start at the accumulation boundary)",
              "neighbours": "every microbatch but one (pipeline sends)"}


def _explain(result, cluster) -> str:
    """``--explain``: per phase what is exposed and why (the same figures as --json's phases)."""
    from smp_adapter.plan import timing

    if cluster.cpu_ranks:
        return ("per phase: nothing overlaps on CPU ranks (gloo runs each collective in line with the compute): all "
                f"{result.comm_s:.3f} s of collectives show")
    lines = ["per phase (each link's collectives run beside the phase's compute, the links at once; what the busier "
             "link needs beyond the compute shows):"]
    windows, critical = timing.phases(result.comm, cluster, result.compute_s, result.microbatches, result.passes)
    for p in windows:
        links = ", ".join(f"{link} {seconds:.3f} s" for link, seconds in sorted(p.links.items()))
        verdict = f"{p.exposed_s:.3f} s shows" if p.exposed_s > 0 else "hidden"
        lines.append(f"  {p.name:<14} compute {p.window_s:.3f} s, collectives {links}: {verdict}   [{PHASE_TEXT[p.name]}]")
    lines.append(f"  {'critical path':<14} {critical:.3f} s of collectives nothing hides (tensor parallelism, ZeRO-0's "
                 "all-reduce after backward, ZeRO-1's parameter gather, gathers after the optimizer step)")
    lines.append(f"  exposed in all: {result.exposed_comm_s:.3f} s; latency per call: {cluster.call_latency * 1e6:.1f} us "
                 f"+ per ring step {cluster.intra_node_latency * 1e6:.1f} us inside a node, "
                 f"{cluster.inter_node_latency * 1e6:.1f} us across")
    return "\n".join(lines)


def _gib(n) -> str:
    return f"{n / GiB:8.2f} GiB"


def _text(spec, dims, cluster, job, result, headroom, notes) -> str:
    from smp_adapter.plan import costs, timing

    budget = _budget(cluster, headroom)
    lines = [f"model: {spec.family}, {spec.total_params / 1e6:,.1f}M parameters, {spec.layers} layers, hidden {spec.hidden}, "
             f"sequence {spec.seq_len}; batch {job.batch} per data-parallel rank, microbatches {dims.cfg.microbatches}, "
             f"{job.accumulation} smp.step call(s) per optimizer step (global batch {result.samples}), activation "
             f"checkpointing {'on' if job.activation_checkpointing else 'off'}, {job.optimizer}, {costs.precision(dims.cfg)}",
             f"cluster: {cluster.nodes} x {cluster.name} ({cluster.gpus_per_node} GPUs of {cluster.gpu_memory / GiB:.0f} GiB, "
             f"{cluster.allocatable / GiB:.2f} GiB usable, per node), {cluster.world_size} ranks",
             f"layout: {dims.describe()}" + (f", pipeline {dims.cfg.pipeline}" if dims.pp > 1 else ""),
             _engine_line(dims), "", "memory of the largest rank (pipeline: its stage; activations of the stage holding the most):"]
    for name, value in result.memory.items():
        lines.append(f"  {name:<30}{_gib(value)}")
    verdict = "fits" if result.peak_bytes <= budget else "does NOT fit"
    lines += [f"  {'total':<30}{_gib(result.peak_bytes)}  of {cluster.allocatable / GiB:.2f} GiB usable less "
              f"{headroom:.0%} headroom = {budget / GiB:.2f} GiB: {verdict} ({(budget - result.peak_bytes) / GiB:+.2f} GiB left)",
              "", "communication per optimizer step (bytes as passed by the largest rank):"]
    for group, entry in comm_by_group(result).items():
        ops = ", ".join(f"{op} {v['bytes'] / GB:.3f} GB in {v['calls']} calls"
                        + (f" ({v['overlapped_bytes'] / GB:.3f} GB overlapped with compute)" if v["overlapped_bytes"] else "")
                        for op, v in entry["ops"].items())
        lines.append(f"  {group:<5} intra-node {entry['intra_node_bytes'] / GB:9.3f} GB  inter-node "
                     f"{entry['inter_node_bytes'] / GB:9.3f} GB   ({ops})")
    if cluster.nodes > 1:
        lines.append(f"  each node's network link carries {link_bytes(result, cluster) / GB:.3f} GB a step, each way "
                     f"(ring collectives over {cluster.collectives})")
    source = "calibrated" if result.efficiency_calibrated else "assumed"
    lines += ["", f"step time: {result.step_time_s:.3f} s = compute {result.compute_s:.3f} s (at {result.efficiency:.0%} "
              f"of peak, {source}) + communication not hidden by compute {result.exposed_comm_s:.3f} s (of "
              f"{result.comm_s:.3f} s at {timing.comm_efficiency(cluster):.0%} of link bandwidth) + pipeline bubble "
              f"{result.bubble_s:.3f} s + pipeline actions' fixed cost {result.overhead_s:.3f} s",
              f"predicted throughput: {result.samples_per_s:,.1f} samples/s, {result.tokens_per_s_per_gpu:,.0f} tokens/s "
              f"per GPU, MFU {result.mfu:.1%}", _mfu_line(result)]
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    return "\n".join(lines)


# -- --search ------------------------------------------------------------------------------------------
def _search(args, spec, job_spec, cluster, global_batch, checkpointing, delayed) -> int:
    from smp_adapter.plan.search import search

    result = search(spec, dict(job_spec.options), cluster, global_batch, args.optimizer, args.headroom / 100,
                    (True,) if checkpointing else (False, True), args.cross_node_groups, delayed, args.top)
    shown = result.ranked
    notes = _notices(shown[0].plan, shown[0].dims, cluster) if shown else []
    if args.json:
        print(json.dumps({"cluster": _cluster_dict(cluster), "model": _model_dict(spec), "global_batch": global_batch,
                          "layouts": result.layouts, "plans": result.planned, "fitting_shown": len(shown),
                          "recommended_options": _options(shown[0], notes) if shown else None,
                          "recommended_environment": _setting(shown[0].dims) if shown else None,
                          "ranked": [dict(_layout(r.dims, r.job), **_summary(r.plan, cluster, args.headroom / 100))
                                     for r in shown], "notices": notes}, indent=1))
    else:
        print(_search_text(spec, cluster, result, args.headroom / 100, notes))
        if args.explain and shown:
            print(f"\nthe first row, {_name(shown[0].dims)}: " + _explain(shown[0].plan, cluster))
    return 0


def _name(dims) -> str:
    cfg = dims.cfg
    if dims.mics_group_size > 1:
        zero = f"MiCS {dims.sdp} x {dims.rdp // dims.sdp}"
    else:
        zero = {0: "dp", 1: "ZeRO-1", 3: f"ZeRO-3/{dims.rdp}"}[dims.zero_stage]
        zero += f" hpZ {dims.sdp}" if dims.hpz_partition_size > 1 else ""
    parts = [f"tp {dims.tp}{'p' if cfg.prescaled_batch else ''}", zero]
    if dims.pp > 1:
        schedule = {"interleaved": "1F1B", "interleaved_1f1b": f"i1F1B v{cfg.virtual_pipeline_degree}",
                    "zero_bubble": "ZB", "zbv": "ZBV", "dualpipev": "DualPipeV"}.get(cfg.pipeline, cfg.pipeline)
        parts.insert(0, f"pp {dims.pp} {schedule}")
    return ", ".join(parts)


def _options(row, notes) -> dict:
    """The smp options that run the recommended layout (and delayed init when the host needs it)."""
    cfg = row.dims.cfg
    out = {"ddp": True}
    for key in ("pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree", "microbatches"):
        if getattr(cfg, key) > 1:
            out[key] = getattr(cfg, key)
    if cfg.shard_optimizer_state:
        out["shard_optimizer_state"] = True
    if cfg.prescaled_batch:
        out["prescaled_batch"] = True
    if row.dims.pp > 1 and cfg.pipeline != "interleaved":
        out["pipeline"] = cfg.pipeline
    for key in ("bf16", "fp16", "delayed_parameter_initialization"):
        if getattr(cfg, key):
            out[key] = True
    if any("delayed_parameter_initialization" in n and "does NOT fit" in n for n in notes):
        out["delayed_parameter_initialization"] = True
    return out


def _search_text(spec, cluster, result, headroom, notes) -> str:
    budget = result.budget
    lines = [f"job: {spec.family} {spec.total_params / 1e9:.2f}B parameters, sequence {spec.seq_len}, global batch "
             f"{result.global_batch} samples ({result.global_batch * spec.seq_len:,} tokens) per optimizer step, on "
             f"{cluster.nodes} x {cluster.name} ({cluster.world_size} GPUs)",
             f"{result.layouts} layouts realise it ({result.planned} plans over microbatch sizes); memory budget "
             f"{cluster.allocatable / GiB:.2f} GiB usable less {headroom:.0%} headroom = {budget / GiB:.2f} GiB per GPU", ""]
    if not result.ranked:
        best = min(result.over_memory, key=lambda r: r.plan.peak_bytes, default=None)
        if best is not None:
            lines.append(f"none fits: the smallest is {_name(best.dims)}{', checkpointed' if best.job.activation_checkpointing else ''} "
                         f"at {best.plan.peak_bytes / GiB:.2f} GiB; use more nodes, a larger instance, or a smaller global batch")
        else:
            lines.append("no layout realises this global batch: give a multiple of the data-parallel sizes")
        return "\n".join(lines)
    from smp_adapter.plan.search import TIME_TIE, within_tie

    first = result.ranked[0]
    lines.append(f"ranked by predicted step time, fastest first (the same samples in every row; equal times: more "
                 f"memory left first); ~ marks the rows within {TIME_TIE:.0%} of the first, the time model's error "
                 "(docs/plan.md), which it cannot tell apart")
    lines.append(f"{'#':<4}{'layout':<34}{'engine':<11}{'AC':<4}{'B':>5}{'mb':>5}{'k':>4}{'step s':>9}{'tok/s/GPU':>11}"
                 f"{'MFU':>7}{'exposed comm':>14}{'bubble':>8}{'peak GiB':>10}{'left GiB':>10}{'inter GB':>10}")
    for i, row in enumerate(result.ranked, 1):
        p, dims = row.plan, row.dims
        inter = sum(t.bytes for t in p.comm if not t.intra_node) / GB
        mark = "~" if i > 1 and within_tie(row, first) else ""
        lines.append(f"{str(i) + mark:<4}{_name(dims):<34}{dims.engine:<11}{'on' if row.job.activation_checkpointing else 'off':<4}"
                     f"{row.job.batch:>5}{dims.cfg.microbatches:>5}{row.job.accumulation:>4}{p.step_time_s:9.2f}"
                     f"{p.tokens_per_s_per_gpu:11,.0f}{p.mfu:7.1%}{p.exposed_comm_s:14.2f}{p.bubble_s + p.overhead_s:8.2f}"
                     f"{p.peak_bytes / GiB:10.2f}{row.memory_left / GiB:10.2f}{inter:10.1f}")
    tied = [r for r in result.ranked if within_tie(r, first)]
    roomiest = max(tied, key=lambda r: r.memory_left)
    if roomiest is not first:
        lines.append(f"of the rows within {TIME_TIE:.0%} of the first, {_name(roomiest.dims)} "
                     f"({'checkpointed, ' if roomiest.job.activation_checkpointing else ''}B {roomiest.job.batch}) "
                     f"leaves the most memory: {roomiest.memory_left / GiB:.2f} GiB against {first.memory_left / GiB:.2f}")
    lines.append(_mfu_line(first.plan))
    lines += ["", "(B: samples per rank per smp.step call; mb: microbatches; k: smp.step calls per optimizer step, "
              "DistributedModel(backward_passes_per_step=k); tp Np: prescaled_batch; MiCS N x R: smp v1's MiCS, groups "
              "of N = sharded_data_parallel_degree ranks sharding everything, R replicas, on the mics engine (torch "
              "FSDP2), the default below rdp; hpZ N: the same sdp on DeepSpeed ZeRO-3 + hpZ, chosen by "
              "SMP_ADAPTER_SDP_ENGINE=hpz)", ""]
    for i, row in enumerate(result.ranked[:-1], 1):
        lines.append(f"{i}. {_why(row, result.ranked[i])}")
    best = result.ranked[0]
    lines += ["", f"recommended smp options: {json.dumps(_options(best, notes))} with a per-rank batch of {best.job.batch}"
              + (f" and DistributedModel(..., backward_passes_per_step={best.job.accumulation})"
                 if best.job.accumulation > 1 else "")
              + "".join(f" and {k}={v} in the job's environment" for k, v in _setting(best.dims).items()
                        if v != "mics")]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _why(row, nxt) -> str:
    """Why ``row`` ranks above ``nxt``: faster, by what and mostly where (and when the difference is
    within the time model's error, that it is)."""
    from smp_adapter.plan.search import TIME_TIE, within_tie

    p, q = row.plan, nxt.plan
    if q.step_time_s == p.step_time_s:
        return (f"{_name(row.dims)}: the same step time as {_name(nxt.dims)} ({p.step_time_s:.2f} s), more memory left "
                f"({row.memory_left / GiB:.1f} vs {nxt.memory_left / GiB:.1f} GiB)")
    diffs = {"exposed communication": q.exposed_comm_s - p.exposed_comm_s, "compute": q.compute_s - p.compute_s,
             "pipeline bubble and actions": q.bubble_s + q.overhead_s - p.bubble_s - p.overhead_s}
    what, gain = max(diffs.items(), key=lambda kv: kv[1])
    tie = f" (within the model's {TIME_TIE:.0%}: a tie)" if within_tie(nxt, row) else ""
    faster = q.step_time_s / p.step_time_s - 1
    # differences below 0.1 % of a step (a few calls' latency) would print as 0.0 %: give them in seconds
    by = f"{faster:.1%} faster than" if faster >= 0.001 else f"faster by {q.step_time_s - p.step_time_s:.1e} s than"
    amount = f"{gain:.2f} s" if gain >= 0.005 else f"{gain:.1e} s"
    return f"{_name(row.dims)}: {by} {_name(nxt.dims)}{tie}, mostly less {what} ({amount} per step)"


def _mfu_line(result) -> str:
    """MFU as what it is here: a prediction, the model's FLOPs over the predicted step time, whose
    ceiling is the compute efficiency plan assumed or calibrated (recompute and exposed time lower it)."""
    source = "calibrated on published runs" if result.efficiency_calibrated else "assumed, not calibrated"
    return (f"MFU is predicted, not measured: the model's FLOPs over the predicted step time x GPUs x peak; it cannot "
            f"exceed the compute efficiency plan takes for this GPU ({result.efficiency:.0%} of peak, {source}), "
            f"which recompute (3 of 4 passes count), exposed communication and the bubble lower")
