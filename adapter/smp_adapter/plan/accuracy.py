"""Plan against measurement: the communication ledger of a run (bytes per step per group of one
rank) beside the plan's prediction for the same layout. Used by tests/distributed/test_comm_ledger.py
and benchmarks/plan_accuracy.py. Pure: no torch."""

from __future__ import annotations

from smp_adapter.plan.instances import Cluster

# "self": a group of one rank moves nothing over a link; barriers carry no payload
NOT_TRAFFIC_GROUPS, NOT_TRAFFIC_OPS = ("self",), ("barrier",)


def cpu_cluster(ranks: int) -> Cluster:
    """A one-node cluster of ``ranks`` CPU processes (the figures only matter for time, not bytes)."""
    return Cluster("cpu", ranks, 1, 1 << 40, {"fp32": 1e11, "fp16": 1e11, "bf16": 1e11}, 1e10, 1e10,
                   collectives="gloo")


def ledger_bytes_per_group(records: list[dict], skip_first: bool = True, quantity: str = "bytes") -> dict[str, float]:
    """Mean bytes (or, quantity "calls", calls) per training step per group, of one rank's ledger records
    (the first step left out: it includes one-time traffic such as ZeRO-3's first gathers and the
    pipeline's stage setup)."""
    steps = [r for r in records if r.get("step") is not None]
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    out: dict[str, float] = {}
    for record in steps:
        for op in record["ops"]:
            if op["group"] in NOT_TRAFFIC_GROUPS or op["op"] in NOT_TRAFFIC_OPS:
                continue
            out[op["group"]] = out.get(op["group"], 0.0) + op[quantity] / len(steps)
    return out


def plan_bytes_per_group(result, quantity: str = "bytes") -> dict[str, float]:
    """Bytes (or calls) per optimizer step per group of a plan."""
    out: dict[str, float] = {}
    for term in result.comm:
        out[term.group] = out.get(term.group, 0.0) + getattr(term, quantity)
    return out


def compare(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, tuple[float, float, float]]:
    """group -> (measured, predicted, relative error of the prediction)."""
    rows = {}
    for group in sorted(set(measured) | set(predicted)):
        m, p = measured.get(group, 0.0), predicted.get(group, 0.0)
        rows[group] = (m, p, (p - m) / m if m else float("inf") if p else 0.0)
    return rows
