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
    # the options given, and always the key transformers' Trainer looks for: partitions = the pipeline degree
    options = spec["smp_options"]
    pp = options.get("partitions", options.get("pipeline_parallel_degree", 1))
    assert json.loads(exported["SM_HP_MP_PARAMETERS"].strip("'")) == {**options, "partitions": pp}
    assert f"x {spec.get('nproc_per_node', 1)} processes" in out
    assert str(path.parent / spec["script"]) in out


def test_no_mp_parameters_leaves_the_argument_out_and_partitions_is_always_there(tmp_path, capsys, monkeypatch):
    """SageMaker's --mp_parameters argument is passed unless --no-mp-parameters says not to (HfArgumentParser
    on transformers 5 refuses it); either way SM_HP_MP_PARAMETERS holds the options with partitions beside
    pipeline_parallel_degree, so transformers' Trainer detects smp (docs/launch.md §3)."""
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for flags, passed in (([], True), (["--no-mp-parameters"], False)):
        code = main(["launch", "--cpu", "--dry-run", *flags, "--options", '{"pipeline_parallel_degree": 2, "microbatches": 2}',
                     "--job-dir", str(tmp_path / "job"), str(script), "--mine", "1"])
        out = capsys.readouterr().out
        assert code == 0, out
        command = out.splitlines()[[i for i, line in enumerate(out.splitlines()) if str(script) in line and
                                    not line.startswith("export ")][0]]
        assert ("--mp_parameters microbatches=2,pipeline_parallel_degree=2" in command) == passed, command
        assert command.endswith("--mine 1"), command
        assert "export SM_HP_MP_PARAMETERS='{\"microbatches\":2,\"partitions\":2,\"pipeline_parallel_degree\":2}'" in out
