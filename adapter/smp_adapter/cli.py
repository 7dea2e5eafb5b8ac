"""``smp-adapter`` command line: ``smp-adapter <command> ...``.

Each command lives in ``smp_adapter/commands/<name>.py`` with ``add_parser(subparsers)`` (which
registers its arguments) and ``run(args) -> int``; adding a command is adding its name below.
Errors smp-adapter raises on purpose (``SMPAdapterError``: bad options, bad files, ...) print
their message and exit with status 2, without a traceback; anything else is a bug and propagates.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from smp_adapter import __version__
from smp_adapter.errors import SMPAdapterError

COMMANDS = ("translate", "launch", "check", "report", "checkpoint", "plan")  # add a command: create commands/<name>.py and list it here
EXIT_USAGE = 2  # same status as argparse usage errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smp-adapter",
        description="Run SageMaker model parallelism v1 scripts on DeepSpeed, torch FSDP2, Megatron-core and torch "
                    "pipelining (the layout picks the engine: `smp-adapter translate OPTIONS --explain` names it).")
    parser.add_argument("--version", action="version", version=f"smp-adapter {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"smp_adapter.commands.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(run_command=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0) and usage errors (2): return, don't exit
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.run_command(args)
    except SMPAdapterError as exc:
        print(f"smp-adapter {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `smp-adapter check x.py | head`: the reader left, nothing is wrong
        import os

        sys.stdout = open(os.devnull, "w")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
