"""``smp-adapter plan OPTIONS --model CONFIG``: memory, communication and step time of a layout on a
cluster, before launching (docs/plan.md). The formulas are plan/costs.py; the layout rules are the
config layer's (ParallelDims); ``--search`` ranks every valid layout that fits."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smp_adapter.config.problems import ConfigProblem, raise_if_any

NAME = "plan"
GiB, GB = 2**30, 10**9


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="predict memory, traffic and step time of a layout on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("options", metavar="OPTIONS", help="smp options, a distribution dict (file or inline JSON)")
    p.add_argument("--model", required=True, metavar="CONFIG", help="Hugging Face config.json or its directory")
    p.add_argument("--batch-size", type=int, required=True, metavar="B", help="batch per data-parallel rank (smp.step)")
    p.add_argument("--seq-len", type=int, metavar="S", help="sequence length (default: the config's; images: patches + 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="every transformer layer checkpointed")
    p.add_argument("--script", metavar="train.py", help="read activation checkpointing from the script (static check)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--instance-type", metavar="TYPE", help="e.g. ml.p4d.24xlarge (docs/plan.md lists them)")
    p.add_argument("--instance-count", type=int, default=1, metavar="N")
    hw = p.add_argument_group("hardware described explicitly (instead of --instance-type)")
    hw.add_argument("--gpus-per-node", type=int)
    hw.add_argument("--gpu-memory", type=float, metavar="GiB")
    hw.add_argument("--intra-node-bandwidth", type=float, metavar="GB/s", help="per GPU, per direction")
    hw.add_argument("--inter-node-bandwidth", type=float, metavar="GB/s", help="per node, per direction")
    hw.add_argument("--gpu-flops", type=float, metavar="TFLOP/s", help="peak dense FLOP/s at the job's precision")
    p.add_argument("--search", action="store_true",
                   help="rank every valid layout that fits by predicted throughput (samples/s at the given per-rank batch)")
    p.add_argument("--top", type=int, default=5, help="layouts shown by --search (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def cluster_from_args(args):
    from smp_adapter.plan.instances import GB as _GB, Cluster, instance_cluster

    explicit = [args.gpus_per_node, args.gpu_memory, args.intra_node_bandwidth, args.inter_node_bandwidth, args.gpu_flops]
    if args.instance_type:
        return instance_cluster(args.instance_type, args.instance_count)
    if any(v is None for v in explicit):
        raise_if_any([ConfigProblem("--instance-type", "is missing and the hardware is not fully described",
                                    "give --instance-type ml.p4d.24xlarge --instance-count N, or all of --gpus-per-node "
                                    "--gpu-memory --intra-node-bandwidth --inter-node-bandwidth --gpu-flops")])
    if any(v <= 0 for v in explicit) or args.instance_count < 1:
        raise_if_any([ConfigProblem("hardware", "every figure must be positive", "give positive numbers")])
    flops = args.gpu_flops * 1e12
    return Cluster("custom", args.gpus_per_node, args.instance_count, int(args.gpu_memory * GiB),
                   {"fp32": flops, "fp16": flops, "bf16": flops}, args.intra_node_bandwidth * _GB,
                   args.inter_node_bandwidth * _GB)


def script_checkpoints(path: str) -> bool:
    from smp_adapter.script_check import check_source

    try:
        source = Path(path).read_text()
    except OSError as exc:
        raise_if_any([ConfigProblem("--script", f"cannot be read ({exc.strerror})", "give the training script's path", path)])
    return any(u.name == "set_activation_checkpointing" for u in check_source(source, path).uses)


def run(args) -> int:
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.distribution import load_job
    from smp_adapter.plan import costs
    from smp_adapter.plan.layouts import model_problems, valid_layouts
    from smp_adapter.plan.model_spec import model_spec

    job_spec = load_job(args.options)
    cluster = cluster_from_args(args)
    spec = model_spec(args.model, args.seq_len)
    checkpointing = args.activation_checkpointing or (bool(args.script) and script_checkpoints(args.script))
    if args.batch_size < 1:
        raise_if_any([ConfigProblem("--batch-size", "must be a positive integer", "give the per-rank batch", args.batch_size)])
    job = costs.Job(args.batch_size, checkpointing, args.optimizer)
    cfg = job_spec.config()
    if args.search:
        layouts = valid_layouts(dict(job_spec.options), cluster.world_size, args.batch_size, spec)
        results = [(d, _plan(spec, d, cluster, job)) for d in layouts]
        fitting = sorted([(d, p) for d, p in results if p.peak_bytes <= cluster.gpu_memory], key=lambda r: -r[1].samples_per_s)
        if args.json:
            print(json.dumps({"cluster": _cluster_dict(cluster), "valid_layouts": len(results),
                              "fitting": [dict(_layout(d), **_summary(p, cluster)) for d, p in fitting]}, indent=1))
        else:
            print(_search_text(spec, cluster, job, results, fitting, args.top))
        return 0
    dims = ParallelDims.from_config(cfg, cluster.world_size)
    raise_if_any(model_problems(spec, dims.tp))
    dims.micro_batch_size(args.batch_size)
    result = _plan(spec, dims, cluster, job)
    if args.json:
        print(json.dumps({"layout": _layout(dims), "cluster": _cluster_dict(cluster), "model": _model_dict(spec),
                          "activation_checkpointing": checkpointing, **_summary(result, cluster)}, indent=1))
    else:
        print(_text(spec, dims, cluster, job, result))
    return 0


def _plan(spec, dims, cluster, job):
    from smp_adapter.plan import costs

    try:
        return costs.plan(spec, dims, cluster, job)
    except ValueError as exc:  # the precision the GPU lacks (T4: bf16)
        raise_if_any([ConfigProblem("bf16" if dims.cfg.bf16 else "fp16", str(exc), "use fp16 or fp32 on this GPU")])


def _layout(dims) -> dict:
    return {"pipeline_parallel_degree": dims.pp, "tensor_parallel_degree": dims.tp, "rdp": dims.rdp,
            "sharded_data_parallel_degree": dims.sdp, "zero_stage": dims.zero_stage,
            "hpz_partition_size": dims.hpz_partition_size, "microbatches": dims.cfg.microbatches}


def _cluster_dict(c) -> dict:
    return {"name": c.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu_memory_bytes": c.gpu_memory,
            "intra_node_bandwidth": c.intra_node_bandwidth, "inter_node_bandwidth": c.inter_node_bandwidth}


def _model_dict(spec) -> dict:
    return {"family": spec.family, "parameters": spec.total_params, "layers": spec.layers, "hidden": spec.hidden,
            "seq_len": spec.seq_len}


def comm_by_group(result) -> dict:
    out: dict = {}
    for term in result.comm:
        entry = out.setdefault(term.group, {"intra_node_bytes": 0, "inter_node_bytes": 0, "ops": {}})
        entry["intra_node_bytes" if term.intra_node else "inter_node_bytes"] += int(term.bytes)
        op = entry["ops"].setdefault(term.op, {"bytes": 0, "calls": 0})
        op["bytes"] += int(term.bytes)
        op["calls"] += int(term.calls)
    return out


def _summary(result, cluster) -> dict:
    return {"fits": result.peak_bytes <= cluster.gpu_memory, "peak_memory_bytes": int(result.peak_bytes),
            "memory_breakdown": {k: int(v) for k, v in result.memory.items()},
            "comm_bytes_per_step": comm_by_group(result), "step_time_s": result.step_time_s,
            "global_batch": result.samples, "samples_per_s": result.samples_per_s,
            "compute_s": result.compute_s, "comm_s": result.comm_s, "bubble_s": result.bubble_s}


def _gib(n) -> str:
    return f"{n / GiB:8.2f} GiB"


def _text(spec, dims, cluster, job, result) -> str:
    from smp_adapter.plan import costs

    lines = [f"model: {spec.family}, {spec.total_params / 1e6:,.1f}M parameters, {spec.layers} layers, hidden {spec.hidden}, "
             f"sequence {spec.seq_len}; batch {job.batch} per data-parallel rank, microbatches {dims.cfg.microbatches}, "
             f"activation checkpointing {'on' if job.activation_checkpointing else 'off'}, {job.optimizer}, "
             f"{costs.precision(dims.cfg)}",
             f"cluster: {cluster.nodes} x {cluster.name} ({cluster.gpus_per_node} GPUs of {cluster.gpu_memory / GiB:.0f} GiB "
             f"per node), {cluster.world_size} ranks",
             f"layout: {dims.describe()}",
             "", "memory of the largest rank (pipeline: stage 0, activations of the stage holding the most):"]
    for name, value in result.memory.items():
        lines.append(f"  {name:<30}{_gib(value)}")
    verdict = "fits" if result.peak_bytes <= cluster.gpu_memory else "does NOT fit"
    lines += [f"  {'total':<30}{_gib(result.peak_bytes)}  of {cluster.gpu_memory / GiB:.1f} GiB: {verdict}", "",
              "communication per step (bytes as passed by the largest rank):"]
    for group, entry in comm_by_group(result).items():
        ops = ", ".join(f"{op} {v['bytes'] / GB:.3f} GB in {v['calls']} calls" for op, v in entry["ops"].items())
        lines.append(f"  {group:<5} intra-node {entry['intra_node_bytes'] / GB:9.3f} GB  inter-node "
                     f"{entry['inter_node_bytes'] / GB:9.3f} GB   ({ops})")
    lines += ["", f"step time: {result.step_time_s:.3f} s = compute {result.compute_s:.3f} s (at "
              f"{costs.COMPUTE_EFFICIENCY:.0%} of peak) + communication {result.comm_s:.3f} s (ring/tree at "
              f"{costs.COMM_EFFICIENCY:.0%} of link bandwidth, not overlapped) + pipeline bubble {result.bubble_s:.3f} s"]
    return "\n".join(lines)


def _name(dims) -> str:
    extra = f" hpZ {dims.hpz_partition_size}" if dims.hpz_partition_size > 1 else ""
    return (f"pp {dims.pp} tp {dims.tp} sdp {dims.sdp} zero {dims.zero_stage}{extra} mb {dims.cfg.microbatches}")


def _search_text(spec, cluster, job, results, fitting, top) -> str:
    lines = [f"{len(results)} valid layouts for {cluster.world_size} ranks ({cluster.nodes} x {cluster.name}); "
             f"{len(fitting)} fit in {cluster.gpu_memory / GiB:.1f} GiB", ""]
    if not fitting:
        best = min(results, key=lambda r: r[1].peak_bytes, default=None)
        if best is not None:
            lines.append(f"none fits: the smallest is {_name(best[0])} at {best[1].peak_bytes / GiB:.2f} GiB; use more "
                         "nodes, activation checkpointing, or a smaller batch")
        return "\n".join(lines)
    lines.append("ranked by samples/s: a layout's global batch is its data-parallel size x the per-rank batch "
                 "(smp's batch arithmetic), so step times of different layouts cover different numbers of samples")
    lines.append(f"{'rank':<5}{'layout':<38}{'samples/s':>10}{'batch':>7}{'step s':>8}{'compute':>9}{'comm':>8}"
                 f"{'bubble':>8}{'peak GiB':>10}{'inter-node GB':>15}")
    for i, (dims, p) in enumerate(fitting[:top], 1):
        inter = sum(t.bytes for t in p.comm if not t.intra_node) / GB
        lines.append(f"{i:<5}{_name(dims):<38}{p.samples_per_s:10.1f}{p.samples:7d}{p.step_time_s:8.3f}{p.compute_s:9.3f}"
                     f"{p.comm_s:8.3f}{p.bubble_s:8.3f}{p.peak_bytes / GiB:10.2f}{inter:15.3f}")
    lines.append("")
    for i, (dims, p) in enumerate(fitting[:top], 1):
        if i < len(fitting):
            lines.append(f"{i}. {_name(dims)}: {_why(p, fitting[i][1], fitting[i][0])}")
    return "\n".join(lines)


def _why(p, q, q_dims) -> str:
    """What makes layout p faster than the next one, q: the component that differs most."""
    per_sample = lambda r, x: x / r.samples  # noqa: E731 - seconds per sample of one component
    diffs = {"communication": per_sample(q, q.comm_s) - per_sample(p, p.comm_s),
             "compute": per_sample(q, q.compute_s) - per_sample(p, p.compute_s),
             "pipeline bubble": per_sample(q, q.bubble_s) - per_sample(p, p.bubble_s)}
    what, gain = max(diffs.items(), key=lambda kv: kv[1])
    inter_p = sum(t.bytes for t in p.comm if not t.intra_node) / GB / p.samples
    inter_q = sum(t.bytes for t in q.comm if not t.intra_node) / GB / q.samples
    return (f"{p.samples_per_s / q.samples_per_s - 1:.1%} more samples/s than {_name(q_dims)}, mostly less "
            f"{what} per sample ({gain * 1e3:.2f} ms); inter-node traffic {inter_p * 1e3:.1f} MB vs {inter_q * 1e3:.1f} MB "
            "per sample")
