"""launch/rank_env.py: ranks and rendezvous read from what torchrun, mpirun and srun set (pure)."""

from __future__ import annotations

import pytest

from smp_adapter.errors import SMPUsageError
from smp_adapter.launch.rank_env import LaunchEnv, rendezvous, slurm_first_host, slurm_tasks_per_node


def no_port():
    raise AssertionError("a free port was not expected here")


def test_torchrun_variables_win_over_the_others():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert LaunchEnv.from_environ(env) == LaunchEnv("torch", 3, 4, 1, 2)


def test_open_mpi_ranks_as_smp_v1_read_them():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    launch = LaunchEnv.from_environ(env)
    assert launch == LaunchEnv("mpirun", 5, 8, 1, 4) and not launch.single_node


SLURM_TWO_NODES = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
                   "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123456",
                   "SLURM_JOB_NODELIST": "trn[07-08]", "SLURM_STEP_NODELIST": "trn[07-08]"}


def test_slurm_step_ranks_and_master_from_the_nodelist():
    launch = LaunchEnv.from_environ(SLURM_TWO_NODES)
    assert launch == LaunchEnv("srun", 3, 4, 1, 2)
    assert rendezvous(launch, None, SLURM_TWO_NODES, no_port) == ("trn07", 20000 + 123456 % 10000)


def test_slurm_without_step_variables_uses_the_job_ones():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7"}
    launch = LaunchEnv.from_environ(env)
    assert launch == LaunchEnv("srun", 0, 2, 0, 2)
    assert rendezvous(launch, 4321, env, no_port) == ("node1", 4321)  # ddp_port before the job-id port


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node[01-04]", "node01"), ("gpu[03-05,9]-ib,login1", "gpu03-ib"),
    ("a1,b[2-3]", "a1"), ("rack[2,4]-n[10-11]", "rack2-n10"), ("127.0.0.1,127.0.0.2", "127.0.0.1"),
])
def test_slurm_first_host(nodelist, first):
    assert slurm_first_host(nodelist) == first


def test_slurm_tasks_per_node():
    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(SMPUsageError) as err:
        slurm_tasks_per_node("two")
    assert "SLURM tasks per node 'two' cannot be read: expected e.g. '2(x3),1'" in str(err.value)


def test_mpirun_defaults_to_sagemakers_port_and_sm_hosts_master():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "SM_HOSTS": '["algo-2", "algo-1"]'}
    assert rendezvous(LaunchEnv.from_environ(env), None, env, no_port) == ("algo-1", 7777)


def test_several_nodes_without_any_master_address_are_refused():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(SMPUsageError) as err:
        rendezvous(LaunchEnv.from_environ(env), None, env, no_port)
    assert str(err.value).startswith("4 ranks on several nodes (2 on this one) and no MASTER_ADDR: export "
                                     "MASTER_ADDR=<address of the node running rank 0>")


def test_explicit_master_variables_win():
    env = {**SLURM_TWO_NODES, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29511"}
    assert rendezvous(LaunchEnv.from_environ(env), 4321, env, no_port) == ("10.0.0.9", 29511)


def test_one_process_without_a_launcher_takes_a_free_port():
    assert rendezvous(LaunchEnv.from_environ({}), None, {}, lambda: 40001) == ("127.0.0.1", 40001)


def test_a_garbled_rank_variable_names_itself():
    with pytest.raises(SMPUsageError) as err:
        LaunchEnv.from_environ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
    assert str(err.value).startswith("SLURM_PROCID='x' is not an integer: the launcher that started this process set it")


def test_the_launcher_knows_there_is_no_gpu_without_importing_torch(monkeypatch):
    """`smp-adapter launch` decides CPU or GPU before starting the ranks: where the answer is certain
    (every GPU hidden, or no GPU device node) it does not pay torch's import (2-3 s a launch)."""
    import subprocess
    import sys

    from smp_adapter.launch import inputs as launch_inputs

    assert launch_inputs.cuda_available({"CUDA_VISIBLE_DEVICES": ""}) is False
    assert launch_inputs.cuda_available({"CUDA_VISIBLE_DEVICES": "-1"}) is False
    import glob

    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert launch_inputs.cuda_available({}) is False
    code = ("import sys; from smp_adapter.launch.inputs import cuda_available; "
            "print(cuda_available({'CUDA_VISIBLE_DEVICES': ''}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["False", "False"], out


def test_with_a_gpu_device_node_torch_is_asked(monkeypatch):
    import glob

    import torch

    from smp_adapter.launch import inputs as launch_inputs

    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else [])
    for answer in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: answer)
        assert launch_inputs.cuda_available({"CUDA_VISIBLE_DEVICES": "0"}) is answer
