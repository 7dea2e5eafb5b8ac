"""``smp-adapter report RUN_DIR``: a loss/throughput plot and a summary table for a run, or the
summary of a communication ledger.

RUN_DIR is what a recipe run writes (smp-adapter launch --recipe FILE.yaml): metrics.jsonl, one
JSON object per step (step, loss, step_time_s, tokens_per_s: the one timer the mean step time is
taken from), and summary.json (layout, peak memory per rank, ...). report writes report.png and
report.txt there and prints the table.

Or a communication ledger directory (rank<r>.jsonl, from smp-adapter launch --comm-ledger DIR or
SMP_ADAPTER_COMM_LEDGER=DIR): what each rank sent per step, per group, and pipeline idle time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smp_adapter.errors import SMPUsageError


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SMPUsageError(nothing_to_report(run_dir))
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise SMPUsageError(f"{path}:{number} is not a JSON line; the metrics file is damaged") from None
    if not rows:
        raise SMPUsageError(f"{path} holds no steps yet")
    return rows


def nothing_to_report(run_dir: Path) -> str:
    """What to give report instead, and what this directory does hold (a launch's job directory keeps its
    ranks' output, which report does not read)."""
    from smp_adapter.launch.job import RANK_LOGS

    what = (f"{run_dir} has no metrics.jsonl (what a recipe writes in its run directory) and no communication "
            "ledger (rank<r>.jsonl)")
    if not run_dir.is_dir():
        what = f"{run_dir} is not a directory"
    elif (run_dir / RANK_LOGS).is_dir():
        what += f"; it is a launch's job directory: its ranks' output is in {run_dir / RANK_LOGS}"
    return (f"{what}. Fix: give the run directory of a recipe run (smp-adapter launch --recipe FILE.yaml; the "
            "directory it prints), or a ledger directory: launch with --comm-ledger DIR, then smp-adapter report DIR")


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in rows], color="tab:blue")
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_tput.plot(steps, [r.get("tokens_per_s", 0) for r in rows], color="tab:green")
    ax_tput.set(xlabel="step", ylabel="tokens / s (all ranks)", title="throughput")
    for ax in (ax_loss, ax_tput):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary_table(rows: list[dict], summary: dict) -> str:
    steady = rows[1:] or rows  # the first step includes engine warm-up
    mean_step = sum(r["step_time_s"] for r in steady) / len(steady)
    mean_tput = sum(r.get("tokens_per_s", 0) for r in steady) / len(steady)
    lines = [f"{'layout':<28}{summary['layout']}"] if "layout" in summary else []
    lines += [f"{'steps':<28}{rows[-1]['step']}",
             f"{'first / last loss':<28}{rows[0]['loss']:.4f} / {rows[-1]['loss']:.4f}",
             f"{'mean step time (s)':<28}{mean_step:.4f}" + ("" if steady is rows else " (after the first step)"),
             f"{'mean tokens/s (all ranks)':<28}{mean_tput:.0f}"]
    for rank, mib in enumerate(summary.get("peak_rss_mib_per_rank", [])):
        lines.append(f"{f'peak RSS rank {rank} (MiB)':<28}{mib:.0f}")
    if "generation" in summary:
        lines.append(f"{'generation':<28}{summary['generation']!r}")
    return "\n".join(lines)


def write_report(run_dir: str | Path) -> tuple[Path, str]:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    png = plot(rows, run_dir / "report.png")
    table = summary_table(rows, summary)
    (run_dir / "report.txt").write_text(table + "\n")
    return png, table


def add_parser(subparsers):
    p = subparsers.add_parser("report", help="write a loss/throughput PNG and a summary table for a run directory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the recipe's run directory (holds metrics.jsonl), or a communication ledger "
                                  "directory (rank<r>.jsonl, from SMP_ADAPTER_COMM_LEDGER / launch --comm-ledger)")
    return p


def run(args) -> int:
    from smp_adapter.ledger.summary import ledger_dir, ledger_table

    run_dir = Path(args.run_dir)
    ledger = ledger_dir(run_dir)
    if ledger is None or (run_dir / "metrics.jsonl").exists():
        png, table = write_report(run_dir)
        print(table)
        print(f"plot: {png}")
    if ledger is not None:
        print(ledger_table(ledger))
    return 0
