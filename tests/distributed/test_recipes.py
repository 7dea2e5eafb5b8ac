"""The recipes run at a tiny size as `smp-adapter launch --recipe` runs them (the deepspeed launcher,
CPU), and produce what they promise. Every recipe *script* runs here; recipes that differ from a
run one only in smp options and hyperparameters (vit_ddp and vit_sdp beside vit_mics, llama_sdp beside
gpt2_sdp) are resolved through `launch --dry-run` in tests/unit/test_recipe_files.py, and their
options are trained against references in the data-parallel and delayed-init tests: each run here
costs 15-40 s of the two CI cores.

The data-parallel recipes run through the whole launcher (DeepSpeed's runner and launch.py starting
the ranks, their output streamed); the model-parallel ones with the environment and arguments
launch gives the ranks, the ranks forked from the test process's job server
(launch_util.run_as_launched says why): their subject is their parallelism, and the launcher's part
is the same for every recipe."""

import json
import subprocess
import sys

import pytest
from launch_util import MAIN, ROOT, base_env, run_as_launched

# recipe -> hyperparameter overrides that keep the run short
RECIPES = {
    "causal_lm/gpt2_sdp.yaml": {"steps": 6, "checkpoint_every": 3},
    "classification/bert_zero1.yaml": {"steps": 4},
    "classic/vit_mics.yaml": {"steps": 2},
    "classic/convnet_tp.yaml": {"samples": 64},
    "classic/convnet_tp_pp.yaml": {"samples": 64},
    "classic/manual_partition.yaml": {"samples": 64},
    "causal_lm/gpt2_tp.yaml": {"steps": 3},
    "causal_lm/gpt2_pp.yaml": {"steps": 3},
    "hf_trainer/gpt2_trainer.yaml": {"steps": 20},
}
THROUGH_LAUNCHER = {"causal_lm/gpt2_sdp.yaml", "classification/bert_zero1.yaml", "hf_trainer/gpt2_trainer.yaml"}


def launch_recipe(recipe: str, run_dir, overrides: dict) -> str:
    """The recipe's job, through the whole launcher or as launched (module docstring): its output."""
    args = ["--recipe", str(ROOT / "recipes" / recipe), "--job-dir", str(run_dir / "job")]
    for key, value in {**overrides, "run_dir": str(run_dir)}.items():
        args += ["--hp", f"{key}={value}"]
    if recipe not in THROUGH_LAUNCHER:
        return run_as_launched(*args, cwd=run_dir, timeout=400)
    cmd = [sys.executable, "-c", MAIN, "launch", *args, "--timeout", "400"]
    result = subprocess.run(cmd, env=base_env(), cwd=run_dir, capture_output=True, text=True, timeout=450)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def test_every_recipe_script_is_run_here():
    import yaml

    scripts = {}
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        name = str(path.relative_to(ROOT / "recipes"))
        scripts[name] = path.parent / yaml.safe_load(path.read_text())["script"]
    run = {scripts[name] for name in RECIPES}
    assert set(scripts.values()) <= run, sorted(str(p) for p in set(scripts.values()) - run)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_runs_through_launch(recipe, tmp_path):
    output = launch_recipe(recipe, tmp_path, RECIPES[recipe])
    assert "Traceback" not in output
    if recipe.startswith("causal_lm/"):
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert len(summary["peak_rss_mib_per_rank"]) == summary["world_size"]
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model") is not None
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == RECIPES[recipe]["steps"]
    if recipe == "causal_lm/gpt2_sdp.yaml":
        assert (tmp_path / "checkpoints" / "newest").read_text().strip() == "step6"
        report = subprocess.run([sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())",
                                 "report", str(tmp_path)], env=base_env(), capture_output=True, text=True)
        assert report.returncode == 0 and (tmp_path / "report.png").stat().st_size > 1000
        assert "peak RSS rank 1" in report.stdout
        assert report.stdout.splitlines()[0].split(None, 1) == ["layout", summary["layout"]]  # the recipe's own
        assert summary["layout"].startswith("pp 1 x tp 1 x rdp 2, sdp 2")
    if recipe == "hf_trainer/gpt2_trainer.yaml":
        _check_trainer_run(output, tmp_path)


def _check_trainer_run(output: str, run_dir) -> None:
    """transformers' Trainer drove smp itself (its SageMaker-MP path) on CPU ranks: the optimizer it
    creates exists (compat/hf_transformers.py), both ranks end with the same reduced loss,
    the logged loss falls from about ln(vocabulary) = 5.6, and rank 0's saved model loads."""
    import re

    from transformers import GPT2LMHeadModel

    finals = re.findall(r"\[rank (\d)\] final training loss ([0-9.]+)", output)
    assert sorted(rank for rank, _ in finals) == ["0", "1"] and len({loss for _, loss in finals}) == 1, finals
    logged = [float(x) for x in re.findall(r"'loss': '([0-9.]+)'", output)]
    assert len(logged) == 4 and logged[-1] < logged[0] - 0.5, logged
    assert GPT2LMHeadModel.from_pretrained(run_dir) is not None
