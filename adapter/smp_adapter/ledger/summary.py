"""Summary of a communication ledger (ledger/record.py): ``smp-adapter report RUN_DIR`` prints
it when RUN_DIR (or RUN_DIR/comm_ledger) holds rank<r>.jsonl files. Pure: no torch.

Per group and link class (intra-node / inter-node): calls and bytes per training step (mean over
the steps recorded, the first step left out when there are more, as it includes warm-up traffic),
summed over ranks; then the traffic outside steps per phase."""

from __future__ import annotations

import json
from pathlib import Path

from smp_adapter.errors import SMPUsageError


def ledger_dir(run_dir: Path) -> Path | None:
    for candidate in (run_dir, run_dir / "comm_ledger"):
        if any(candidate.glob("rank*.jsonl")):
            return candidate
    return None


def read_ledger(directory: Path) -> dict[int, list[dict]]:
    records = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        try:
            rank = int(path.stem[4:])
        except ValueError:
            continue
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row["ops"]  # noqa: B018 - every record has its ops
            except (ValueError, KeyError, TypeError):
                raise SMPUsageError(f"{path}:{number} is not a ledger record (JSON with 'step' and 'ops'); the file is "
                                    "damaged: rerun the job with the ledger on") from None
            rows.append(row)
        records[rank] = rows
    return records


def summarise(records: dict[int, list[dict]]) -> dict:
    """{"steps": n, "per_step": {(group, link, op): [calls, bytes]}, "phases": {(phase, group, link): [calls, bytes]}}"""
    per_step, phases, steps = {}, {}, set()
    for rows in records.values():
        step_rows = [r for r in rows if r.get("step") is not None]
        indices = sorted({r["step"] for r in step_rows})
        kept = set(indices[1:] or indices)
        steps |= kept
        for r in rows:
            link_of = lambda o: "intra-node" if o["intra_node"] else "inter-node"  # noqa: E731
            if r.get("step") is None:
                for o in r["ops"]:
                    entry = phases.setdefault((r.get("phase", "?"), o["group"], link_of(o)), [0, 0])
                    entry[0] += o["calls"]
                    entry[1] += o["bytes"]
            elif r["step"] in kept:
                for o in r["ops"]:
                    entry = per_step.setdefault((o["group"], link_of(o), o["op"]), [0, 0])
                    entry[0] += o["calls"] / len(kept)
                    entry[1] += o["bytes"] / len(kept)
    return {"ranks": len(records), "steps": len(steps), "per_step": per_step, "phases": phases}


def ledger_table(directory: Path) -> str:
    s = summarise(read_ledger(directory))
    lines = [f"communication ledger: {s['ranks']} ranks, {s['steps']} steady steps averaged (all ranks summed)",
             f"{'group':<8}{'link':<12}{'op':<16}{'calls/step':>12}{'MB/step':>14}"]
    for (group, link, op), (calls, nbytes) in sorted(s["per_step"].items()):
        lines.append(f"{group:<8}{link:<12}{op:<16}{calls:12.1f}{nbytes / 1e6:14.3f}")
    lines += pipeline_idle_lines(read_ledger(directory))
    if s["phases"]:
        lines.append(f"{'phase':<14}{'group':<8}{'link':<12}{'calls':>10}{'MB':>14}   (outside training steps)")
        for (phase, group, link), (calls, nbytes) in sorted(s["phases"].items()):
            lines.append(f"{phase:<14}{group:<8}{link:<12}{calls:10d}{nbytes / 1e6:14.3f}")
    return "\n".join(lines)


def pipeline_idle_lines(records: dict[int, list[dict]]) -> list[str]:
    """Each rank's measured pipeline idle fraction, 1 - compute / schedule time summed over its steps
    (the first left out when there are more, as in ``summarise``), next to the bubble formula."""
    lines = []
    for rank, rows in sorted(records.items()):
        timed = [r["pipeline"] for r in rows if r.get("step") is not None and isinstance(r.get("pipeline"), dict)]
        timed = timed[1:] or timed
        wall = sum(t.get("wall_s", 0.0) for t in timed)
        if not timed or wall <= 0:
            continue
        busy = sum(t.get("busy_s", 0.0) for t in timed)
        if not lines:
            lines.append(f"pipeline idle per rank ({timed[-1].get('schedule', '?')}, bubble {timed[-1].get('bubble', '?')};"
                         " F, B, W: a stage's forward, backward, weight-gradient time per microbatch)")
            lines.append(f"{'rank':<6}{'steps':>6}{'schedule ms/step':>18}{'compute ms/step':>17}{'idle':>8}")
        lines.append(f"{rank:<6}{len(timed):>6}{wall / len(timed) * 1e3:18.1f}{busy / len(timed) * 1e3:17.1f}"
                     f"{max(0.0, 1 - busy / wall):8.1%}")
    return lines
