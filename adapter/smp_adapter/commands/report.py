"""``smp-adapter report RUN_DIR``: plot and summary of a recipe run."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("report", help="write a loss/throughput PNG and a summary table for a run directory")
    p.add_argument("run_dir", help="the recipe's run directory (holds metrics.jsonl), or a communication ledger "
                                  "directory (rank<r>.jsonl, from SMP_ADAPTER_COMM_LEDGER / launch --comm-ledger)")
    return p


def run(args) -> int:
    from pathlib import Path

    from smp_adapter.ledger_report import ledger_dir, ledger_table
    from smp_adapter.report import write_report

    run_dir = Path(args.run_dir)
    ledger = ledger_dir(run_dir)
    if ledger is None or (run_dir / "metrics.jsonl").exists():
        png, table = write_report(run_dir)
        print(table)
        print(f"plot: {png}")
    if ledger is not None:
        print(ledger_table(ledger))
    return 0
