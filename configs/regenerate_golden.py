"""Rewrite configs/golden/<name>.json from configs/<name>.yaml.

    PYTHONPATH=adapter python configs/regenerate_golden.py

Each golden file is the full output of ``smp-adapter translate <file> --format json`` with the
fixed settings below (per-rank batch 8, script train.py, master port 29500, GPU launch). Run this after an
intended change of the translation, review ``git diff configs/golden``, and commit both.
tests/unit/test_translate.py fails on any difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent
GOLDEN = CONFIGS / "golden"
SCRIPT = "train.py"
BATCH = 8  # per-rank batch passed to smp.step: divisible by every microbatches value used here
MASTER_PORT = 29500


def config_files() -> list[Path]:
    return sorted(p for p in CONFIGS.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def golden_for(path: Path) -> dict:
    from smp_adapter.commands.translate import translation_bundle
    from smp_adapter.config.distribution import load_job

    bundle = translation_bundle(load_job(str(path)), batch_size=BATCH, script=SCRIPT, master_port=MASTER_PORT)
    return {"input": path.name, **bundle}


def render(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    sys.path.insert(0, str(CONFIGS.parent / "adapter"))
    GOLDEN.mkdir(exist_ok=True)
    for path in config_files():
        target = GOLDEN / f"{path.stem}.json"
        target.write_text(render(golden_for(path)))
        print(f"wrote {target.relative_to(CONFIGS.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
