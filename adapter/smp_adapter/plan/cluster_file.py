"""``plan --cluster FILE``: one's own nodes described in YAML, for hardware no table holds.

    base: 8xH100-SXM            # optional: a node preset or SageMaker instance type to start from
    nodes: 4
    gpus_per_node: 8
    gpu: H100-SXM-80GB          # a GPU plan knows (its memory, peaks and compute efficiency), or give:
    gpu_memory_gib: 80          #   what PyTorch can allocate per GPU
    tflops: 989                 #   peak dense TFLOP/s (one figure, or {fp32: .., fp16: .., bf16: ..})
    intra_node: nvlink          # nvlink | pcie: the link class (NCCL's latency for it)
    intra_node_gbytes: 450      # GB/s per GPU, per direction
    inter_node_gbit: 3200       # Gbit/s per node, per direction (all its NICs)
    host_memory_gib: 2048       # optional
    collectives: nccl           # optional: nccl | gloo (CPU ranks)
    latency_us: {call: 8.4, intra_node: 3.4, inter_node: 14.0}   # optional: per call, per ring step

Every key is checked (unknown ones are refused with the closest known name); the units are the ones
vendors print. Pure: reads a file, makes a Cluster.
"""

from __future__ import annotations

import dataclasses
import difflib

from smp_adapter.config.problems import MISSING
from smp_adapter.plan.input_errors import PlanInputError
from smp_adapter.plan.instances import (GBIT, GPUS, INSTANCE_TYPES, NCCL_LATENCY, NODE_PRESETS, TFLOPS, US, Cluster,
                                        GiB, table_cluster)

LABEL = "cluster file"
KEYS = ("base", "nodes", "gpus_per_node", "gpu", "gpu_memory_gib", "tflops", "intra_node", "intra_node_gbytes",
        "inter_node_gbit", "host_memory_gib", "collectives", "latency_us", "name")
LINKS = ("nvlink", "pcie")


def _bad(key, message, fix, value):
    raise PlanInputError(LABEL, key, message, fix, value)


def _positive(data: dict, key: str, kind=float):
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (kind is int and value != int(value)):
        _bad(key, f"must be a positive {'integer' if kind is int else 'number'}", f"give {key} as a number", value)
    return kind(value)


def read_cluster_file(path: str, nodes: int | None = None) -> Cluster:
    """The Cluster a YAML file describes; ``nodes`` (the command line's count) wins over the file's."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        _bad("--cluster", f"cannot be read ({exc.strerror})", "give the cluster file's path", path)
    except yaml.YAMLError as exc:
        _bad("--cluster", f"is not YAML ({str(exc).splitlines()[0]})", "fix the file (docs/plan.md shows one)", path)
    if not isinstance(data, dict):
        _bad("--cluster", "is not a mapping of keys to values", "write key: value lines (docs/plan.md shows one)", path)
    for key in data:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            _bad(key, "is not a key plan reads", (f"did you mean {close[0]}? " if close else "")
                 + f"The keys: {', '.join(KEYS)}", data[key])
    cluster = _base(data)
    return _override(cluster, data, nodes)


def _base(data: dict) -> Cluster | None:
    base = data.get("base")
    if base is None:
        return None
    table = {**INSTANCE_TYPES, **NODE_PRESETS}
    if base not in table:
        close = difflib.get_close_matches(str(base), list(table), n=2, cutoff=0.5)
        _bad("base", "is not a node preset or SageMaker instance type plan knows",
             (f"did you mean {' or '.join(close)}? " if close else "") + f"Use one of {', '.join(table)}", base)
    return table_cluster(base, table[base], 1)


def _gpu_figures(data: dict, cluster: Cluster | None) -> dict:
    """memory, usable memory, peaks and the efficiency key, from ``gpu`` or the explicit keys over the base."""
    out = {}
    if data.get("gpu") is not None:
        gpu = GPUS.get(data["gpu"])
        if gpu is None:
            close = difflib.get_close_matches(str(data["gpu"]), list(GPUS), n=2, cutoff=0.4)
            _bad("gpu", "is not a GPU plan knows", (f"did you mean {' or '.join(close)}? " if close else "")
                 + f"Use one of {', '.join(GPUS)}, or give gpu_memory_gib and tflops", data["gpu"])
        out.update(gpu_memory=gpu.memory, usable_memory=gpu.usable_memory, flops=gpu.flops, gpu=gpu.name)
    memory = _positive(data, "gpu_memory_gib")
    if memory is not None:
        out.update(gpu_memory=int(memory * GiB), usable_memory=int(memory * GiB))
    tflops = data.get("tflops")
    if tflops is not None:
        by_precision = tflops if isinstance(tflops, dict) else {"fp32": tflops, "fp16": tflops, "bf16": tflops}
        for key in by_precision:
            if key not in ("fp32", "fp16", "bf16"):
                _bad("tflops", f"has a precision {key!r} plan does not know", "use fp32, fp16, bf16", tflops)
            _positive(by_precision, key)
        out["flops"] = {k: (by_precision[k] * TFLOPS if by_precision.get(k) else None) for k in ("fp32", "fp16", "bf16")}
        if data.get("gpu") is None:
            out["gpu"] = ""  # described by the user: no calibrated efficiency applies
    if cluster is None:
        for key, needed in (("gpu_memory", "gpu or gpu_memory_gib"), ("flops", "gpu or tflops")):
            if key not in out:
                _bad(needed.split()[-1], "is missing", f"give {needed} (or a base to start from)", MISSING)
    return out


def _override(cluster: Cluster | None, data: dict, nodes: int | None) -> Cluster:
    fields = _gpu_figures(data, cluster)
    per_node = _positive(data, "gpus_per_node", int)
    count = nodes or _positive(data, "nodes", int) or (cluster.nodes if cluster else 1)
    intra = _positive(data, "intra_node_gbytes")
    inter = _positive(data, "inter_node_gbit")
    host = _positive(data, "host_memory_gib")
    link = data.get("intra_node")
    if link is not None and link not in LINKS:
        _bad("intra_node", "is not a link class plan knows", f"use one of {', '.join(LINKS)}", link)
    collectives = data.get("collectives", cluster.collectives if cluster else "nccl")
    if collectives not in ("nccl", "gloo"):
        _bad("collectives", "is not a collective library plan knows", "use nccl (GPUs) or gloo (CPU ranks)", collectives)
    if cluster is None:
        for key, value in (("gpus_per_node", per_node), ("intra_node_gbytes", intra), ("inter_node_gbit", inter)):
            if value is None:
                _bad(key, "is missing", f"give {key} (or a base to start from)", MISSING)
        cluster = Cluster(data.get("name", "custom"), per_node, count, fields["gpu_memory"], fields["flops"],
                          intra * 1e9, inter * GBIT)
    latency = _latencies(data, link, collectives, cluster)
    return dataclasses.replace(
        cluster, name=str(data.get("name", cluster.name)), nodes=count, gpus_per_node=per_node or cluster.gpus_per_node,
        intra_node_bandwidth=intra * 1e9 if intra else cluster.intra_node_bandwidth,
        inter_node_bandwidth=inter * GBIT if inter else cluster.inter_node_bandwidth,
        host_memory=int(host * GiB) if host else cluster.host_memory, collectives=collectives, **fields, **latency)


def _latencies(data: dict, link, collectives: str, cluster: Cluster) -> dict:
    """NCCL's latencies for the link classes unless the file gives its own; none for gloo (its per-call
    cost is inside the gloo efficiency measured on CPU ranks)."""
    given = data.get("latency_us") or {}
    if not isinstance(given, dict) or any(k not in ("call", "intra_node", "inter_node") for k in given):
        _bad("latency_us", "must map call / intra_node / inter_node to microseconds", "e.g. {call: 8.4}", given)
    for key in given:
        if isinstance(given[key], bool) or not isinstance(given[key], (int, float)) or given[key] < 0:
            _bad(f"latency_us.{key}", "must be a number of microseconds, 0 or more", "e.g. 14.0", given[key])
    if collectives == "gloo":
        default = {"call": 0.0, "intra_node": 0.0, "inter_node": 0.0}
    else:
        intra_class = link or ("nvlink" if cluster.intra_node_latency == NCCL_LATENCY["nvlink"] else "pcie")
        default = {"call": NCCL_LATENCY["call"] / US, "intra_node": NCCL_LATENCY[intra_class] / US,
                   "inter_node": NCCL_LATENCY["net"] / US}
    us = {**default, **given}
    return {"call_latency": us["call"] * US, "intra_node_latency": us["intra_node"] * US,
            "inter_node_latency": us["inter_node"] * US}
