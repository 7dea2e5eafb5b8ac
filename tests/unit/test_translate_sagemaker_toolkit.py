"""`smp-adapter translate` of a seed 001 estimator distribution prints the mpirun line SageMaker's
training toolkit builds for it beside what `smp-adapter launch` would run. The line itself is
checked against the real toolkit in tests/distributed/test_sagemaker_toolkit.py; here its parts."""

from __future__ import annotations

import json
import shlex

import pytest

from smp_adapter.cli import main
from smp_adapter.config.distribution import job_from_mapping
from smp_adapter.launch.sagemaker_toolkit import SAGEMAKER_TOOLKIT, TRAINING_VARIABLES

# seed 001: an estimator's distribution, custom_mpi_options as the page's example writes it
SEED_001 = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "--mca btl_vader_single_copy_mechanism none"}}


def _translate(tmp_path, capsys, dist, *argv):
    path = tmp_path / "distribution.json"
    path.write_text(json.dumps(dist))
    assert main(["translate", str(path), *argv]) == 0
    return capsys.readouterr().out


def _section(out: str, heading: str) -> list[str]:
    lines = out.split(heading, 1)[1].splitlines()[1:]
    return lines[:next((i for i, line in enumerate(lines) if not line.startswith("  ")), len(lines))]


def test_translate_prints_the_toolkit_line_beside_the_launch_commands(tmp_path, capsys):
    out = _translate(tmp_path, capsys, {**SEED_001, "instance_count": 2})
    assert "Launch with mpirun:" in out and "Launch with torchrun:" in out
    toolkit = _section(out, "SageMaker training toolkit (sagemaker-training 5.1.x with sagemaker-pytorch-training 3.0.x) "
                            "runs, on the first host:")
    cmd = shlex.split(toolkit[0])
    assert cmd[:6] == ["mpirun", "--host", "algo-1:8,algo-2:8", "-np", "16", "--allow-run-as-root"]
    assert cmd[cmd.index("-bind-to"):cmd.index("-bind-to") + 4] == ["-bind-to", "none", "-map-by", "slot"]
    # the toolkit puts the custom options after its own, so the MCA parameter is there twice
    assert toolkit[0].count("btl_vader_single_copy_mechanism none") == 2
    assert cmd[cmd.index("mpi4py") + 1:] == ["train.py", "--mp_parameters", "ddp=True,microbatches=4,pipeline_parallel_degree=2"]
    assert ["-x", "NCCL_PROTO=simple", "-x", "NCCL_ALGO=ring"] == cmd[cmd.index("PYTHONPATH") + 1:cmd.index("PYTHONPATH") + 5]
    notes = [line.strip() for line in toolkit[1:]]
    assert any("needs Open MPI 4" in n and "/usr/sbin/sshd" in n for n in notes)
    assert any("repeats the MCA parameter btl_vader_single_copy_mechanism" in n and "remove" in n and
               "MCA parameters can only be listed once" in n for n in notes)
    # what smp-adapter launch runs for the same dict: the parameter once, Open MPI 4 or 5 spelling
    mpirun = _section(out, "Launch with mpirun:")[0].split(" mpirun ", 1)[1]  # the command, not its environment
    assert mpirun.count("btl_vader_single_copy_mechanism") == 1 and "--bind-to none" in mpirun


def test_plain_options_have_no_toolkit_line(tmp_path, capsys):
    out = _translate(tmp_path, capsys, {"ddp": True, "pipeline_parallel_degree": 2})
    assert "Launch with mpirun:" in out and "SageMaker training toolkit" not in out  # SageMaker needs the dict


@pytest.mark.parametrize("instance_type, efa", [("ml.p3.16xlarge", []),
                                                ("ml.p4d.24xlarge", ["FI_PROVIDER=efa", "NCCL_PROTO=simple",
                                                                     "FI_EFA_USE_DEVICE_RDMA=1"]),
                                                ("ml.p3dn.24xlarge", ["FI_PROVIDER=efa", "NCCL_PROTO=simple"])])
def test_toolkit_command_parts(instance_type, efa):
    job = job_from_mapping({**SEED_001, "mpi": {"enabled": True, "processes_per_host": 1,
                                                "custom_mpi_options": "--NCCL_DEBUG WARN -x RDMAV_FORK_SAFE=1"}})
    cmd = list(SAGEMAKER_TOOLKIT.command(job, "train.py", 1, hosts=["algo-1", "algo-2"],
                                         hyperparameters={"epochs": 2, "lr": 0.1}, channels=["train"],
                                         instance_type=instance_type).command)
    assert cmd[1:5] == ["--host", "algo-1,algo-2", "-np", "2"]  # one process per host: bare host names
    assert "NCCL_DEBUG=WARN" in cmd and "NCCL_DEBUG=INFO" not in cmd  # the toolkit's own flag, not mpirun's
    preload = cmd.index(next(a for a in cmd if a.startswith("LD_PRELOAD=")))
    assert cmd[preload + 1:preload + 3] == ["-x", "RDMAV_FORK_SAFE=1"]
    exported = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert [e for e in exported if e.startswith("FI_") or e == "NCCL_PROTO=simple"][:len(efa)] == efa
    names = [e for e in exported if e.startswith("SM_") or e == "PYTHONPATH"]
    assert names == [*TRAINING_VARIABLES, "SM_CHANNEL_TRAIN", "SM_HP_EPOCHS", "SM_HP_LR", "SM_HP_MP_PARAMETERS", "PYTHONPATH"]
    assert cmd[cmd.index("mpi4py") + 1:] == ["train.py", "--epochs", "2", "--lr", "0.1", "--mp_parameters",
                                             "ddp=True,microbatches=4,pipeline_parallel_degree=2"]
