"""``smp-adapter check SCRIPT.py``: which smp v1 APIs a training script uses, and whether they run here.

The script is read with Python's ``ast`` and never executed. Every use of
``smdistributed.modelparallel.torch`` (under any alias), every method called on a
DistributedModel / DistributedOptimizer, and every option dict given to ``smp.init({...})``
(validated like smp.init validates it) is listed with its line and a status:

  supported    carried out as smp v1 did
  partial      runs, with the difference in the note
  unsupported  raises at run time; the note names the alternative
  unknown      not an smp v1 name (AttributeError at run time)
  error        invalid smp options, or a known slip (torch.optim.AdaDelta, transformers 5's ViT layout)
  needs-gpu    CUDA-only call not guarded by torch.cuda.is_available()

Exit status: 0 the script should run as-is (needs-gpu lines run on CPU ranks through launch; they count only with --cpu), 1 it uses
something unsupported/unknown/erroneous, 2 the file cannot be read or does not parse.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smp_adapter.errors import SMPAdapterError
from smp_adapter.check.script import check_source

NAME = "check"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="list a training script's smp API uses and whether smp-adapter supports them",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("script", metavar="SCRIPT.py", help="training script to check (not executed)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--cpu", action="store_true",
                   help="the script will run on CPU *without* smp-adapter launch (python script.py): needs-gpu "
                        "lines then make the exit status 1")
    return p


def run(args: argparse.Namespace) -> int:
    path = Path(args.script)
    try:
        source = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise SMPAdapterError(f"cannot read {args.script} ({exc.strerror or exc}): give the path of a Python script") from None
    except UnicodeDecodeError as exc:
        raise SMPAdapterError(f"{args.script} is not UTF-8 text ({exc.reason}): give a Python source file") from None
    try:
        report = check_source(source, str(args.script))
    except SyntaxError as exc:
        raise SMPAdapterError(f"{args.script}:{exc.lineno}: syntax error: {exc.msg}; fix the script "
                              "(check reads Python 3 source)") from None
    if args.json:
        print(json.dumps(report.to_dict(args.cpu), indent=2))
    else:
        print(report.text(args.cpu))
    return report.exit_status(args.cpu)
