"""Every recipe YAML under recipes/ resolves through `smp-adapter launch --recipe ... --dry-run`: its
script exists, its smp options translate, and the job it would start carries them. (The recipes'
scripts are run for real in tests/distributed/test_recipes.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from smp_adapter.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(str(p.relative_to(ROOT / "recipes")) for p in (ROOT / "recipes").rglob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_resolves_to_a_job(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    path = ROOT / "recipes" / recipe
    spec = yaml.safe_load(path.read_text())
    assert (path.parent / spec["script"]).is_file()
    code = main(["launch", "--recipe", str(path), "--dry-run", "--job-dir", str(tmp_path / "job")])
    out = capsys.readouterr().out
    assert code == 0, out
    exported = dict(line[len("export "):].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    assert json.loads(exported["SM_HP_MP_PARAMETERS"].strip("'")) == spec["smp_options"]
    assert f"x {spec.get('nproc_per_node', 1)} processes" in out
    assert str(path.parent / spec["script"]) in out
