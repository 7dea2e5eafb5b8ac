"""``smp-adapter launch``: --dry-run for the three launchers, real 2-rank CPU jobs through the deepspeed
launcher and torchrun, and the failure paths (a rank raising, a rank SIGKILLed, a timeout) ending
the whole job quickly with the rank's error. The CLI runs as a separate process, like a user's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_util import MAIN, cli_env, parse_dry_run, run_as_launched, run_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/fixtures/launch_train.py"


def launch(*argv, cwd: Path, timeout: float = 120, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", MAIN, "launch", *map(str, argv)], cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.fixture
def job(tmp_path) -> Path:
    """A job directory with a 'train' channel holding 8 samples."""
    (tmp_path / "train").mkdir()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    torch.save({"x": x, "y": x.sum(1, keepdim=True)}, tmp_path / "train" / "data.pt")
    return tmp_path


def dry_run(cwd: Path, *argv, env: dict | None = None) -> tuple[dict, list[str], str]:
    proc, _ = launch("--dry-run", *argv, cwd=cwd, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return (*parse_dry_run(proc.stdout), proc.stdout)


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "mpirun", "srun"])
def test_dry_run_prints_environment_and_command(launcher, job):
    env, cmd, _ = dry_run(job, "--launcher", launcher, "--nproc-per-node", 2, "--cpu", "--options", '{"ddp": true}',
                          "--channel", "train=train", "--hyperparameter", "epochs=3", "--hp", "name=run 1",
                          "--model-dir", "m", SCRIPT, "--extra", "x")
    # with transformers' name of the pipeline degree, which its Trainer looks for (docs/launch.md)
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"ddp": True, "partitions": 1}
    assert json.loads(env["SM_FRAMEWORK_PARAMS"])["sagemaker_mpi_enabled"] is True
    assert env["SM_CHANNEL_TRAIN"] == str(job / "train") and json.loads(env["SM_CHANNELS"]) == ["train"]
    assert env["SM_MODEL_DIR"] == str(job / "m") and env["SM_OUTPUT_DATA_DIR"] == str(job / "smp-job/output/data")
    assert env["SM_NUM_GPUS"] == "0" and env["DS_ACCELERATOR"] == "cpu"
    assert json.loads(env["SM_HPS"]) == {"epochs": 3, "name": "run 1", "mp_parameters": {"ddp": True}}
    assert env["SM_HP_EPOCHS"] == "3" and env["SM_HP_NAME"] == "run 1"
    hp_args = ["--epochs", "3", "--mp_parameters", "ddp=True", "--name", "run 1"]
    assert json.loads(env["SM_USER_ARGS"]) == hp_args
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "adapter")
    assert json.loads(env["SM_TRAINING_ENV"])["channel_input_dirs"] == {"train": str(job / "train")}
    assert cmd[-len(hp_args) - 3:] == [str(SCRIPT), *hp_args, "--extra", "x"]  # hyperparameters first
    if launcher == "deepspeed":
        assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
        assert cmd[3:5] == ["--num_gpus", "2"] and "--no_local_rank" in cmd and "--enable_each_rank_log" in cmd
    elif launcher == "torchrun":
        assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert cmd[3:9] == ["--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0"] and "--tee" in cmd
    elif launcher == "mpirun":
        assert Path(cmd[0]).name == "mpirun" and cmd[cmd.index("-np") + 1] == "2" and "--tag-output" in cmd
        assert cmd[cmd.index(str(SCRIPT)) - 1] == sys.executable
        exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
        assert {"SM_CHANNEL_TRAIN", "SM_MODEL_DIR", "SM_HP_MP_PARAMETERS", "DS_ACCELERATOR"} <= exported
    elif launcher == "srun":  # srun hands the ranks the whole environment
        assert Path(cmd[0]).name == "srun" and cmd[1:8] == ["--nodes", "1", "--ntasks-per-node", "2",
                                                            "--kill-on-bad-exit=1", "--label", "--export=ALL"]
        assert cmd[cmd.index(str(SCRIPT)) - 1] == sys.executable
    assert not (job / "smp-job").exists() and not (job / "m").exists()  # a dry run creates nothing


@pytest.mark.parametrize("front", [["python"], ["--", "python"], ["--", "python3", "-u"]])
def test_a_python_in_front_of_the_script_is_dropped_and_said(front, job):
    """`launch -- python train.py` (the way `mpirun -np 8 python train.py` reads) runs train.py; it used to
    run the interpreter binary as the script (SyntaxError: source code cannot contain null bytes)."""
    env, cmd, out = dry_run(job, "--launcher", "torchrun", "--cpu", "--nproc-per-node", 2, *front, SCRIPT, "--extra", "x")
    assert cmd[-3:] == [str(SCRIPT), "--extra", "x"] and cmd.count(front[-1]) == 0
    dropped = " ".join(t for t in front if t != "--")
    assert f"# note: '{dropped}' in front of the script dropped: every rank runs {SCRIPT} with {sys.executable}" in out


def test_inherited_sm_hp_mp_parameters_are_used_and_the_source_said(job):
    inherited = {"SM_HP_MP_PARAMETERS": '{"ddp": true, "microbatches": 2}'}
    env, _, out = dry_run(job, "--cpu", "--nproc-per-node", 2, SCRIPT, env=inherited)
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"ddp": True, "microbatches": 2, "partitions": 1}
    assert "# note: smp options from SM_HP_MP_PARAMETERS in the environment (--options overrides it)" in out
    env, _, out = dry_run(job, "--cpu", "--nproc-per-node", 2, "--options", '{"ddp": true}', SCRIPT, env=inherited)
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"ddp": True, "partitions": 1}
    assert ("# note: smp options from --options {\"ddp\": true} (overriding SM_HP_MP_PARAMETERS found in the "
            "environment)") in out


def test_dry_run_of_a_recipe_and_torchrun_on_several_nodes(job):
    (job / "code").mkdir()
    (job / "code/train.py").write_text("import smdistributed.modelparallel.torch as smp\nsmp.init()\n")
    recipe = job / "recipe.yaml"
    recipe.write_text("script: code/train.py\nlauncher: torchrun\nnproc_per_node: 2\ndescription: ignored\n"
                      "smp_options: {ddp: true, tensor_parallel_degree: 2}\nhyperparameters: {lr: 0.5}\n")
    env, cmd, _ = dry_run(job, "--recipe", recipe, "--cpu", "--nnodes", 2, "--node-rank", 1,
                          "--master-addr", "10.0.0.1", "--master-port", 29999, "--", "--tail")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:13] == ["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
                         "--master_port", "29999"]
    assert cmd[-6:] == [str(job / "code/train.py"), "--lr", "0.5", "--mp_parameters",
                        "ddp=True,tensor_parallel_degree=2", "--tail"]
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"ddp": True, "tensor_parallel_degree": 2, "partitions": 1}
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"] and env["SM_CURRENT_HOST"] == "algo-2"


@pytest.mark.parametrize("argv, message", [
    (["--options", '{"ddp": "yes"}', SCRIPT], "ddp"),
    (["--options", '{"ddp": true, "pipeline_parallel_degree": 3}', SCRIPT], "pipeline_parallel_degree"),
    (["missing.py"], "not found"),
    (["--hp", "novalue", SCRIPT], "KEY=VALUE"),
    (["--nnodes", "2", SCRIPT], "--hostfile"),
])
def test_bad_options_exit_2_without_traceback(argv, message, job):
    proc, _ = launch("--dry-run", "--cpu", "--nproc-per-node", 2, *argv, cwd=job, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_two_rank_data_parallel_job_on_cpu(launcher, job):
    proc, elapsed = launch("--launcher", launcher, "--nproc-per-node", 2, "--options", '{"ddp": true}',
                           "--channel", "train=train", "--hp", "steps=3", "--hp", "lr=0.05", SCRIPT, "--extra", 1,
                           cwd=job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model_dir = job / "smp-job/model"
    results = [json.loads((model_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert (model_dir / "model.pt").exists()
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == res["dp_size"] == 2 and res["backend"] == "gloo"
        assert res["args"]["steps"] == 3 and res["args"]["lr"] == 0.05 and len(res["losses"]) == 3
        assert res["unknown_args"] == ["--mp_parameters", "ddp=True", "--extra", "1"]
        assert res["launcher_env"]["DS_ACCELERATOR"] == "cpu" and res["num_gpus"] == "0"
        assert json.loads(res["mp_parameters"]) == {"ddp": True, "partitions": 1}
    assert results[0]["weights_sum"] == results[1]["weights_sum"]
    assert results[0]["losses"] != results[1]["losses"]  # each rank saw its own half of the batch
    prefix = "[rank 1] " if launcher == "deepspeed" else "[default1]:"
    assert f"{prefix}rank 1 finished" in proc.stdout


@pytest.mark.parametrize("launcher, mode", [("deepspeed", "raise"), ("torchrun", "kill")])
def test_failing_rank_stops_the_job_with_its_error(launcher, mode, job):
    proc, elapsed = launch("--launcher", launcher, "--nproc-per-node", 2, "--channel", "train=train",
                           "--hp", "steps=6", "--hp", "fail_rank=1", "--hp", "fail_step=2", "--hp", f"fail_mode={mode}",
                           SCRIPT, cwd=job, timeout=120)
    # bounded from the failure, not from the start: start-up (imports, rendezvous) on a loaded machine is not
    # what is tested; after a rank fails, launch notices its exit at once and stops the other within --grace (20 s)
    after_failure = time.time() - float((job / "failed_at.rank1").read_text())
    assert after_failure < 40, f"the job took {after_failure:.0f}s to end after rank 1 failed ({elapsed:.0f}s in all)"
    if mode == "raise":
        assert proc.returncode == 1
        assert "smp-adapter launch: rank 1 failed (exit code 1)" in proc.stderr
        tail = proc.stderr.split("--- last", 1)[1]
        assert "RuntimeError: injected failure in rank 1 at step 2" in tail
    else:
        assert proc.returncode == 128 + 9
        assert "smp-adapter launch: rank 1 failed (killed by signal SIGKILL)" in proc.stderr
    assert not (job / "smp-job/model/rank0.json").exists()  # rank 0 never finished
    assert not running_ranks(job), "ranks left running"


def running_ranks(job: Path, wait: float = 5.0) -> list:
    """Rank processes of this job still alive (not zombies) after ``wait`` seconds."""
    import psutil

    deadline = time.monotonic() + wait
    while True:
        alive = []
        for p in psutil.process_iter(["cmdline", "status", "cwd"]):
            if str(SCRIPT) in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE \
                    and p.info["cwd"] == str(job):
                alive.append(p)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_timeout_stops_the_job_with_124(job):
    (job / "sleep.py").write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n")
    proc, elapsed = launch("--launcher", "torchrun", "--nproc-per-node", 2, "--timeout", 3, "--grace", 2,
                           "--cpu", "sleep.py", cwd=job, timeout=60)
    assert proc.returncode == 124, proc.stderr
    assert "timeout" in proc.stderr and elapsed < 20


LONG_JOB = ROOT / "tests/distributed/scripts/long_job.py"


def test_sigterm_under_the_default_launcher_lets_every_rank_save_and_the_checkpoint_verifies(job):
    """Preemption (Kubernetes, SageMaker managed spot): SIGTERM to `smp-adapter launch` reaches every rank,
    which saves and exits 0 within --grace; the deepspeed runner exiting at once no longer kills them
    (the ranks wait 2 s before saving, as a large checkpoint would take, so a supervisor that stopped
    with the runner would SIGKILL them first)."""
    ready, ckpt = job / "ready", job / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "launch", "--nproc-per-node", "2", "--cpu", "--options",
                             '{"ddp": true}', str(LONG_JOB), "--until-sigterm", "--ready-file", str(ready),
                             "--save-delay", "2", "--ckpt-dir", str(ckpt)], cwd=job, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the job never started training"
        start = time.monotonic()
        proc.send_signal(15)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - start
    assert proc.returncode == 128 + 15, err[-3000:]
    assert "smp-adapter launch: interrupted (SIGTERM, forwarded to every process of the job); every process ended " \
           "by itself" in err
    assert 2 < elapsed < 20, f"{elapsed:.1f} s from SIGTERM to the end (the default --grace is 20 s)"
    tag = (ckpt / "newest").read_text().strip()
    for rank in range(2):
        assert json.loads((job / f"rank{rank}.json").read_text())["saved"] == [int(tag[len("step"):])]
    verify = subprocess.run([sys.executable, "-c", MAIN, "checkpoint", "verify", str(ckpt / f"{tag}_partial")],
                            env=cli_env(), capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_a_syntax_error_is_quoted_with_its_file_and_line(job):
    (job / "broken.py").write_text("import os\n\ndef broken(:\n    pass\n")
    proc, elapsed = launch("--nproc-per-node", 2, "--cpu", "broken.py", cwd=job, timeout=90)
    assert proc.returncode == 1
    assert re.search(r"smp-adapter launch: rank [01] failed \(exit code 1\): SyntaxError: .*\(File \".*broken.py\", "
                     r"line 3\); all ranks were stopped", proc.stderr), proc.stderr[-3000:]


def test_a_collective_timeout_names_the_rank_that_reported_it_not_the_rank_stopped_afterwards(job):
    proc, elapsed = launch("--nproc-per-node", 2, "--cpu", "--grace", 2, "--options", '{"ddp": true}', LONG_JOB,
                           "--hang-rank", 1, "--hang-at-step", 2, cwd=job, timeout=120,
                           env={"SMP_ADAPTER_TIMEOUT": "4"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"smp-adapter launch: rank 0 failed \(exit code 1\): RuntimeError: .*Timed out waiting 4000ms",
                     proc.stderr), proc.stderr[-3000:]
    assert "rank 0 was the first to report a collective timeout: another rank did not reach the same collective" \
           in proc.stderr
    assert "--- last" in proc.stderr and "rank 1 failed" not in proc.stderr


def test_a_checkpoint_dir_or_job_dir_that_cannot_be_written_is_refused_before_starting(job, tmp_path):
    (job / "a_file").write_text("")
    proc, elapsed = launch("--nproc-per-node", 2, "--cpu", "--hp", "checkpoint_dir=a_file/ckpt", LONG_JOB, cwd=job)
    assert proc.returncode == 2 and elapsed < 10
    assert f"hyperparameter checkpoint_dir (checkpoint directory) {job}/a_file/ckpt cannot be written (Not a " \
           "directory)" in proc.stderr, proc.stderr
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        return  # no small file system to fill here: the case above stands for both
    try:
        with open(disk / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:  # full
                pass
        proc, _ = launch("--nproc-per-node", 2, "--cpu", "--job-dir", disk, LONG_JOB, cwd=job)
        assert proc.returncode == 2 and "model directory" in proc.stderr, proc.stderr
        assert re.search(r"(is on a full file system \(0 bytes free\)|cannot be written \(No space left on device\))",
                         proc.stderr), proc.stderr
    finally:
        subprocess.run(["umount", str(disk)], timeout=30)


# The CPU's own instruction set, and AVX2 (CPUs without AVX512, such as AMD EPYC before Zen 4, where a
# forked rank once computed other float32 attention than a launched one: issue 55)
@pytest.mark.parametrize("launcher, capability", [("deepspeed", None), ("torchrun", "avx2")])
def test_forked_ranks_are_given_what_launched_ranks_are_given(launcher, capability, job, monkeypatch):
    """launch_util.run_as_launched, which the AWS-style and model-parallel recipe tests use to run a
    script's ranks forked instead of launched, gives each rank the arguments, working directory and
    environment the launcher gives it (the variables launch sets and the rank's coordinates), and the
    rank computes the same numbers, also when started as most distributed tests start theirs
    (launch_util.run_ranks, without launch's variables, so CUDA on CPU off): after importing smp, the
    same torch threads, CPU capability, attention kernels, matmul precision and numerical libraries'
    variables, and bit-equal results of float32 and bfloat16 attention, a matmul, gelu, softmax and
    layer norm."""
    if capability:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)  # read by the launched and the forked ranks
    script = ROOT / "tests/distributed/scripts/rank_inputs.py"
    seen = {}
    for way in ("launched", "forked"):
        out = job / way
        out.mkdir()
        args = ["--launcher", launcher, "--nproc-per-node", 2, "--options", '{"ddp": true}', "--channel", "train=train",
                "--hp", "epochs=3", "--job-dir", job / "smp-job", script, "--numerics", "--out", out]
        if way == "launched":
            proc, _ = launch(*args, cwd=job)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        else:
            run_as_launched(*args, cwd=job, timeout=60)
        seen[way] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # and as most distributed tests start theirs (run_ranks: the options alone, none of launch's variables)
    plain = job / "plain"
    run_ranks(script, 2, ["--numerics", "--out", plain], env={"SM_HP_MP_PARAMETERS": '{"ddp": true}'}, out_dir=plain,
              timeout=60)
    seen["plain"] = [json.loads((plain / f"rank{r}.json").read_text()) for r in range(2)]
    for launched, forked, started_plain in zip(seen["launched"], seen["forked"], seen["plain"]):
        assert forked["argv"][:-1] == launched["argv"][:-1] and forked["cwd"] == launched["cwd"]
        assert forked["env"] == launched["env"]
        assert forked["numerics"] == launched["numerics"]
        assert started_plain["numerics"] == launched["numerics"]
    assert seen["launched"][1]["env"]["RANK"] == "1" and "SM_CHANNEL_TRAIN" in seen["launched"][1]["env"]
    assert seen["launched"][0]["env"]["SMP_ADAPTER_CUDA_ON_CPU"] == "1"  # the mode is on in both
    if capability:
        assert seen["forked"][0]["numerics"]["capability"] == capability.upper()
