"""``smp-adapter report RUN_DIR``: plot and summary of a recipe run."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("report", help="write a loss/throughput PNG and a summary table for a run directory")
    p.add_argument("run_dir", help="the recipe's run directory (holds metrics.jsonl)")
    return p


def run(args) -> int:
    from smp_adapter.report import write_report

    png, table = write_report(args.run_dir)
    print(table)
    print(f"plot: {png}")
    return 0
