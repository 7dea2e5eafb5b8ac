"""Slurm's own daemons on the namespaced nodes (scripts/netns_slurm.py, docs/cluster.md "Slurm"): munged,
slurmctld in node 0, one slurmd per node (n0 at 10.213.54.1, n1 at .2), one partition. ``sbatch`` of a
script that runs ``srun python train_tp.py`` and then ``smp-adapter launch --launcher srun`` on 2 nodes x 2
tasks (tp 2 x dp 2): the ranks take their world from Slurm's own variables and the master from its nodelist,
and the losses equal one node's. ``scancel`` and a node's death mid-job end every rank, the cause named.

Each test checks that nothing is left: no namespace, no process in the cluster's namespaces, no Slurm
directory (key, configuration, spool, state), no /etc/netns entry. Skipped with a one-line reason where
namespaces cannot be built or Slurm is not installed (the ``slurm_packages`` fixture installs it with apt
where it can)."""

from __future__ import annotations

import json
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
import netns_slurm  # noqa: E402

REASON = netns_cluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

JOB = ROOT / "tests/distributed/scripts/cluster_job.py"
LAUNCH = "from smp_adapter.cli import main; raise SystemExit(main())"
APT_PACKAGES = ("slurm-wlm", "munge")


@pytest.fixture(scope="module")
def slurm_packages():
    reason = apt_install(APT_PACKAGES, netns_slurm.unavailable)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    return one_node_results(tmp_path_factory)


@contextmanager
def slurm_cluster(**kw):
    """Two namespaced nodes with Slurm on them; afterwards nothing of either may be left (checked also on
    failure)."""
    c = netns_cluster.Cluster(nodes=2, rate="1gbit")
    s = netns_slurm.SlurmCluster(c, **kw)
    try:
        with c, s:
            yield c, s
    finally:
        assert c.namespaces() == [], f"namespaces left: {c.namespaces()}"
        assert c.members() == [], f"processes left in the cluster's namespaces: {c.members()}"
        assert s.dir is None or not s.dir.exists(), f"Slurm's directory left: {s.dir}"
        assert not any((netns_slurm.NETNS_ETC / n.ns).exists() for n in c.nodes), "/etc/netns entries left"


def _batch(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2\nset -e\n" + body)
    return script


def _rank_env(out: Path) -> dict:
    return base_env({"SMP_TEST_OUT": str(out), "SM_HP_MP_PARAMETERS": json.dumps(TP_DP),
                     "GLOO_SOCKET_IFNAME": netns_cluster.DEV})


def test_slurm_sbatch_srun_and_launch_tp2_dp2_match_one_node(slurm_packages, one_node, tmp_path):
    """One sbatch job, two steps on 2 nodes x 2 tasks: ``srun python train_tp.py`` (smp.init reads
    SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, the master is the nodelist's first host, n0, resolved
    inside the nodes) and ``smp-adapter launch --launcher srun`` (its srun line run by Slurm for real); both
    give one node's losses within 1e-5."""
    srun_out, launch_out = tmp_path / "srun", tmp_path / "launch"
    srun_out.mkdir()
    launch_out.mkdir()
    body = (f"SMP_TEST_OUT={srun_out} srun --kill-on-bad-exit=1 --label {sys.executable} {TP}\n"
            f"SMP_TEST_OUT={launch_out} {sys.executable} -c '{LAUNCH}' launch --launcher srun --cpu --nnodes 2 "
            f"--nproc-per-node 2 --grace 3 --options '{json.dumps(TP_DP)}' --job-dir {tmp_path / 'job'} {TP}\n")
    with slurm_cluster() as (c, slurm):
        started = time.monotonic()
        proc = slurm.run_in(0, ["sbatch", "--wait", "--output", tmp_path / "slurm.out", _batch(tmp_path, body)],
                            timeout=240, env=_rank_env(srun_out))
        took = time.monotonic() - started
        ctld_log = slurm.log("slurmctld")
    output = (tmp_path / "slurm.out").read_text() if (tmp_path / "slurm.out").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{output[-4000:]}\n{ctld_log[-2000:]}"
    one = one_node
    for out in (srun_out, launch_out):
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        for rank, r in enumerate(results):
            where = r["placement"]
            assert (where["rank"], where["local_rank"]) == (rank, rank % 2)
            assert (where["tp_rank"], where["rdp_rank"]) == (rank % 2, rank // 2)
            assert where["env"]["MASTER_ADDR"] == "n0", where["env"]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one[rank]["losses"]), rtol=1e-5,
                                       atol=1e-5)
    print(f"sbatch job (two steps) took {took:.1f} s")


def _forever_job(slurm, tmp_path: Path) -> subprocess.Popen:
    """``sbatch --wait`` of a job of 2 x 2 ranks that runs until stopped; returned once every rank trained a step."""
    body = (f"srun --kill-on-bad-exit=1 --label {sys.executable} {JOB} --steps 0 --step-sleep 0.2 "
            f"--ready-file {tmp_path / 'ready'}\n")
    proc = slurm.popen(0, ["sbatch", "--wait", "--output", tmp_path / "slurm.out", _batch(tmp_path, body)],
                       env=_rank_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready.{r}").exists() for r in range(4)):
        assert proc.poll() is None, proc.communicate()[1] + _read(tmp_path / "slurm.out")
        assert time.monotonic() < deadline, "the job did not start in 90 s:\n" + _read(tmp_path / "slurm.out")
        time.sleep(0.2)
    return proc


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _rank_pids(c) -> list[int]:
    return [p for i in range(2) for p in c.pids(i) if str(JOB) in netns_cluster._describe(p)]


def _ended(proc: subprocess.Popen, c, seconds: float) -> float:
    start = time.monotonic()
    try:
        proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"sbatch --wait still running {seconds:.0f} s later")
    while _rank_pids(c) and time.monotonic() - start < seconds:
        time.sleep(0.2)
    assert _rank_pids(c) == [], f"ranks left: {[netns_cluster._describe(p) for p in _rank_pids(c)]}"
    return time.monotonic() - start


def test_slurm_scancel_and_a_dead_node_end_every_rank_naming_the_cause(slurm_packages, tmp_path):
    """``scancel`` of a running job: every rank on both nodes ends and the job's output says it was cancelled;
    then node 1 dies (its slurmd and everything else in it SIGKILLed) under a second job: node 0's ranks
    name the lost peer's address, srun ends them, and slurmctld names the node (down after SlurmdTimeout, 10 s
    here) and ends the job."""
    with slurm_cluster(slurmd_timeout=10) as (c, slurm):
        first = tmp_path / "first"
        first.mkdir()
        proc = _forever_job(slurm, first)
        job_id = slurm.run_in(0, ["squeue", "-h", "-o", "%i"], timeout=15).stdout.split()[0]
        slurm.run_in(0, ["scancel", job_id], timeout=15)
        took = _ended(proc, c, 30)
        # the job's own output is the evidence: sbatch --wait's status for a cancelled job is Slurm's, not
        # ours, and a fresh-clone run saw it exit 0 once (2026-12-03, passing in 2 runs here since; the
        # likely cause is slurmctld purging the job's record before sbatch's next poll, MinJobAge 16 s)
        assert "CANCELLED AT" in _read(first / "slurm.out"), (proc.returncode, _read(first / "slurm.out"))
        second = tmp_path / "second"
        second.mkdir()
        proc = _forever_job(slurm, second)
        slurm.kill_slurmd(1)
        for pid in c.pids(1):
            subprocess.run(["kill", "-9", str(pid)], timeout=10)
        took_node = _ended(proc, c, 90)
        out, ctld_log = _read(second / "slurm.out"), slurm.log("slurmctld")
    assert proc.returncode != 0
    # node 0's ranks name the dead peer's address at once (gloo: "Connection closed by peer" or "reset by
    # peer"); srun names the node once slurmctld set it down after SlurmdTimeout, and the job ends
    # (JobRequeue=0: not requeued)
    assert "[10.213.54.2]" in out and "by peer" in out, out[-3000:]
    assert "srun: error: Node failure on n1" in out, out[-3000:] + ctld_log[-2000:]
    print(f"scancel ended the job in {took:.1f} s, a dead node in {took_node:.1f} s\n{out[-1500:]}")
