"""Jobs started over real ssh on the namespaced nodes (scripts/netns_sshd.py, docs/cluster.md "sshd"): an sshd
in each node (host key and user key made by the tool), node names n0/n1 resolved inside the nodes. DeepSpeed's
pdsh runner through ``smp-adapter launch --hostfile`` with the real ``pdsh -R ssh``, and Open MPI's
``mpirun --hostfile`` (``smp-adapter launch --launcher mpirun``) whose ssh agent is the tool's ssh: the
variables (DS_ENV_FILE's bundle, mpirun's ``-x``) reach node 1's ranks over ssh, and a tp 2 x dp 2 job on
2 nodes x 2 ranks gives one node's losses within 1e-5. A node's ranks killed mid-job end the job with the
cause named.

Each test checks that nothing is left (namespaces, processes in them, the tool's key directory, /etc/netns).
Skipped with a one-line reason where namespaces cannot be built or ssh/pdsh are missing and apt cannot
install them (test_multinode.py's fake_remote stand-ins then run instead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from apt_packages import apt_install
from cluster_reference import TP, TP_DP, one_node_results
from launch_util import ROOT, base_env

sys.path.insert(0, str(ROOT / "scripts"))
import netns_cluster  # noqa: E402

REASON = netns_cluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
import netns_sshd  # noqa: E402
import netns_slurm  # noqa: E402

JOB = ROOT / "tests/distributed/scripts/cluster_job.py"
LAUNCH = "from smp_adapter.cli import main; raise SystemExit(main())"
PORT = 29400


@pytest.fixture(scope="module")
def ssh_packages():
    reason = apt_install(("openssh-server", "openssh-client", "pdsh"), netns_sshd.unavailable)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    return one_node_results(tmp_path_factory)


@contextmanager
def ssh_cluster():
    c = netns_cluster.Cluster(nodes=2, rate="1gbit")
    s = netns_sshd.SshCluster(c)
    try:
        with c, s:
            yield c, s
    finally:
        assert c.namespaces() == [], f"namespaces left: {c.namespaces()}"
        assert c.members() == [], f"processes left in the cluster's namespaces: {c.members()}"
        assert s.dir is None or not s.dir.exists(), f"keys left: {s.dir}"
        assert not any((netns_slurm.NETNS_ETC / n.ns).exists() for n in c.nodes), "/etc/netns entries left"


def _launch_in_node0(s, tmp_path: Path, out: Path, *launch_args) -> subprocess.Popen:
    (tmp_path / "hosts").write_text("n0 slots=2\nn1 slots=2\n")
    env = base_env({"SMP_TEST_OUT": str(out), "PRTE_MCA_plm_ssh_agent": str(s.dir / "bin/ssh")})
    argv = [sys.executable, "-c", LAUNCH, "launch", "--hostfile", tmp_path / "hosts", "--cpu", "--master-addr",
            "10.213.54.1", "--master-port", PORT, "--grace", 3, "--job-dir", tmp_path / "job", *launch_args]
    return s.popen(0, argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout: float):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"the launch did not end in {timeout:.0f} s:\n{err[-3000:]}")


def _check_matches(out: Path, one: list[dict]) -> None:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, r in enumerate(results):
        where = r["placement"]
        assert (where["rank"], where["local_rank"]) == (rank, rank % 2)
        assert (where["tp_rank"], where["rdp_rank"]) == (rank % 2, rank // 2)
        assert where["env"]["MASTER_ADDR"] == "10.213.54.1"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one[rank]["losses"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launcher", ["deepspeed", "mpirun"], ids=["pdsh_deepspeed", "sshd_mpirun"])
def test_pdsh_and_mpirun_over_sshd_tp2_dp2_match_one_node(ssh_packages, one_node, tmp_path, launcher):
    """The deepspeed launcher's runner starts ``deepspeed.launcher.launch`` on n0 and n1 with ``pdsh -R ssh``;
    mpirun starts its daemons on them with the tool's ssh (PRTE_MCA_plm_ssh_agent); the smp options reach
    node 1's ranks only through what each launcher carries over ssh (DS_ENV_FILE's bundle, ``-x``)."""
    out = tmp_path  # the job's working directory: SMP_TEST_OUT is not carried over ssh (neither launcher forwards it)
    with ssh_cluster() as (c, s):
        started = time.monotonic()
        proc = _launch_in_node0(s, tmp_path, out, "--launcher", launcher, "--options", json.dumps(TP_DP), TP)
        stdout, stderr = _finish(proc, 200)
        took = time.monotonic() - started
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    if launcher == "deepspeed":  # pdsh prefixes each host's output with its name: node 1's launch ran there
        assert "n1: " in stdout and "node_rank=1" in stdout, stdout[-3000:]
    _check_matches(out, one_node)
    print(f"{launcher} over ssh: {took:.1f} s")


@pytest.mark.skipif(os.environ.get("SMP_TEST_CLUSTER_DRILLS") != "1", reason="a drill by hand (47 s at load 8; CI's "
                    "new-test budget is 3 min and test_slurm_cluster.py's dead-node drill covers a node lost mid-job): "
                    "SMP_TEST_CLUSTER_DRILLS=1 runs it")
def test_sshd_node_ranks_killed_end_the_pdsh_job_naming_the_cause(ssh_packages, tmp_path):
    """Node 1's ranks (children of its sshd session) are SIGKILLed mid-job: the launch on node 0 ends,
    naming the lost peer (node 1's address) and that the failure began elsewhere; no rank is left on either
    node."""
    with ssh_cluster() as (c, s):
        proc = _launch_in_node0(s, tmp_path, tmp_path, "--nproc-per-node", 2, JOB, "--steps", 0, "--step-sleep",
                                0.2, "--ready-file", tmp_path / "ready")
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready.{r}").exists() for r in range(4)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job did not start in 120 s"
            time.sleep(0.2)
        for rank in (2, 3):
            subprocess.run(["kill", "-9", (tmp_path / f"ready.{rank}").read_text()], timeout=10)
        started = time.monotonic()
        stdout, stderr = _finish(proc, 60)
        took = time.monotonic() - started
        left = [p for i in range(2) for p in c.pids(i) if str(JOB) in netns_cluster._describe(p)]
    assert proc.returncode != 0
    assert left == [], left
    # node 0's launch names its rank that lost node 1's (gloo names the peer's address) and says the failure
    # began on another node
    assert "[10.213.54.2]" in stderr and "by peer" in stderr, stderr[-3000:]
    assert "which failed first and is not one of this launcher's" in stderr, stderr[-3000:]
    print(f"ended {took:.1f} s after node 1's ranks were killed:\n{stderr[-1500:]}")
