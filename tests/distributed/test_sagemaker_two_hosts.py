"""SageMaker's own training toolkit (unchanged, as in test_sagemaker_toolkit.py) on two hosts ``algo-1`` and
``algo-2``: two namespaced nodes of scripts/netns_cluster.py, each a container of its own (private mount and
PID namespaces over the node's network namespace: its /opt/ml with resourceconfig.json naming the host and
both hosts, /etc/hosts naming both, /root/.ssh with the job's key as an image has it, its own /tmp and
/etc/environment). The toolkit's ``train`` runs on both, as SageMaker starts it on every instance:

* it starts ``/usr/sbin/sshd -D`` itself on each host; that path is the real sshd (OpenSSH) run with the
  node's configuration from scripts/netns_sshd.py (host key, the job's authorized key, listening on eth0);
* algo-2, the worker, waits until it can log in to algo-1 (paramiko, with the key in /root/.ssh), starts its
  sshd, waits for Open MPI's ``orted`` to appear and end, then for the leader's status file
  (/tmp/done.algo-1, which the leader touches over ssh), and exits;
* algo-1, the leader, waits until it can log in to algo-2, then runs its own mpirun line (``--host
  algo-1:2,algo-2:2``, eth0): Open MPI reaches algo-2 over ssh and starts orted there, whose ranks see
  algo-2's /opt/ml. It reports in algo-1's /opt/ml/output.

Both sides sleep 30 s after mpirun ends (the toolkit's own waits), which is most of each job's time.
Skipped with the reason where namespaces or the toolkit's environment cannot be built or sshd is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from apt_packages import apt_install
from launch_util import MAIN, cli_env
from sagemaker_job import ROOT, container_argv, container_dir, namespaces_unavailable, toolkit_env, \
    toolkit_env_vars, write_job

sys.path.insert(0, str(ROOT / "scripts"))
import netns_cluster  # noqa: E402
import netns_slurm  # noqa: E402
import netns_sshd  # noqa: E402

SCRIPT = ROOT / "tests/fixtures/sagemaker_toolkit/train_seed_style.py"
HOSTS = ("algo-1", "algo-2")
STEPS = 3
PER_HOST = 2
EFA_OPTIONS = "-x FI_EFA_USE_DEVICE_RDMA=1 -x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1"
SDP2 = {"ddp": True, "sharded_data_parallel_degree": 2}
PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}
# the image's login PATH (sshd's SetEnv): Open MPI starts `orted` by name in an ssh session on algo-2. The worker
# toolkit appends its environment to /etc/environment for those sessions, which sshd without PAM does not read,
# and with UsePAM=yes (tried once) orted was still not found: "bash: line 1: orted: command not found"
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_UNAVAILABLE = namespaces_unavailable() or netns_cluster.unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"two toolkit hosts: {_UNAVAILABLE}")


def distribution(parameters: dict, processes_per_host: int = PER_HOST) -> dict:
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}},
            "mpi": {"enabled": True, "processes_per_host": processes_per_host, "custom_mpi_options": EFA_OPTIONS}}


def train_data() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(STEPS, 16, 8, generator=g), "y": torch.randint(0, 4, (STEPS, 16), generator=g)}


def _sshd_missing():
    return netns_sshd.unavailable(("sshd", "ssh", "ssh-keygen"))


@pytest.fixture(scope="module")
def toolkit():
    reason = apt_install(("openssh-server", "openssh-client"), _sshd_missing)
    if reason:
        pytest.skip(reason)
    return toolkit_env()


def one_node_losses(tmp_path: Path, parameters: dict) -> list[list[float]]:
    """Each rank's losses for the same script under `smp-adapter launch` on one node of 4 ranks."""
    job = tmp_path / "launch"
    job.mkdir(exist_ok=True)
    (job / "train").mkdir(exist_ok=True)
    torch.save(train_data(), job / "train/data.pt")
    name = "sdp" if "sharded_data_parallel_degree" in parameters else "pp"
    (job / f"{name}.json").write_text(json.dumps(distribution(parameters, len(HOSTS) * PER_HOST)))
    proc = subprocess.run([sys.executable, "-c", MAIN, "launch", "--launcher", "torchrun", "--cpu", "--distribution",
                           str(job / f"{name}.json"), "--channel", f"train={job / 'train'}", "--job-dir",
                           str(job / name), "--hp", f"steps={STEPS}", str(SCRIPT)], cwd=job, env=cli_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((job / name / f"output/data/rank{r}.json").read_text())["losses"] for r in range(4)]


@contextmanager
def two_hosts(venv: Path):
    """Two nodes named algo-1 and algo-2 (also n0, n1), the job's keys and each node's sshd configuration; after
    it, nothing of them is left."""
    c = netns_cluster.Cluster(nodes=2, rate="1gbit")
    s = netns_sshd.SshCluster(c, extra_names={0: [HOSTS[0]], 1: [HOSTS[1]]}, start_daemons=False,
                              login_env={"PATH": f"{venv / 'bin'}:{LOGIN_PATH}"})
    root_ssh = Path("/root/.ssh").exists()
    try:
        with c, s:
            yield c, s
    finally:
        assert c.namespaces() == [], f"namespaces left: {c.namespaces()}"
        assert c.members() == [], f"processes left in the nodes: {c.members()}"
        assert s.dir is None or not s.dir.exists(), f"keys left: {s.dir}"
        assert not any((netns_slurm.NETNS_ETC / n.ns).exists() for n in c.nodes), "/etc/netns entries left"
        # what the containers wrote into their own /tmp, /root and /etc stayed there
        assert not Path("/tmp/done.algo-1").exists() and Path("/root/.ssh").exists() == root_ssh


class Host:
    def __init__(self, index: int, base: Path, proc: subprocess.Popen, log: Path):
        self.index, self.base, self.proc, self.log = index, base, proc, log

    @property
    def output(self) -> str:
        return self.log.read_text()


def start_job(c, s, venv: Path, where: Path, parameters: dict, hps: dict) -> list[Host]:
    """The toolkit's ``train`` in a container on each node, worker first (SageMaker starts all at once)."""
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {HOSTS[n.index]}\n" for n in c.nodes)
    started = []
    for i in reversed(range(len(HOSTS))):
        base = write_job(where / HOSTS[i] / "opt_ml", distribution(parameters), SCRIPT, hps, train_data(),
                         hosts=HOSTS, current_host=HOSTS[i], network_interface="eth0")
        ns = base.parent / (base.name + ".ns")
        ns.mkdir()
        # the toolkit runs `/usr/sbin/sshd -D`: the real sshd (a copy: /usr/sbin is this script there) with the
        # node's configuration
        shutil.copy(shutil.which("sshd", path="/usr/sbin:/usr/bin"), ns / "sshd.real")
        container_dir(base, hosts_file,
                      f"#!/bin/sh\nexec {ns / 'sshd.real'} -e -f {s.sshd_config(i)} \"$@\" 2>>{ns / 'sshd.log'}\n")
        (ns / "ssh").mkdir()
        shutil.copy(s.key, ns / "ssh/id_ed25519")  # paramiko (the toolkit's wait for hosts) looks for it here
        shutil.copy(s.client_config, ns / "ssh/config")  # ssh (Open MPI's, the status file's) reads it
        shutil.copy("/etc/environment", ns / "environment") if Path("/etc/environment").exists() else \
            (ns / "environment").write_text("")
        log = where / f"{HOSTS[i]}.log"
        with open(log, "w") as out:
            proc = c.popen(i, container_argv(venv), env=toolkit_env_vars(base, ns, venv, {
                               # SageMaker's own base: the paths mpirun -x carries to algo-2 are its own there
                               "SMP_TEST_HOSTS": "1", "SMP_JOB_DIR": str(base), "SAGEMAKER_BASE_DIR": "/opt/ml"}),
                           stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(Host(i, base, proc, log))
    return sorted(started, key=lambda h: h.index)


def wait_all(hosts: list[Host], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for h in hosts:
        try:
            h.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{HOSTS[h.index]}'s train did not end in {timeout:.0f} s:\n" +
                                 "\n".join(f"--- {HOSTS[x.index]}\n{x.output[-3000:]}" for x in hosts))


def test_two_hosts_toolkit_sdp_and_pp_jobs_match_one_node(toolkit, tmp_path):
    """A seed 001-style sdp 2 job and a pp 2 job, 2 hosts x 2 processes, each on its own pair of nodes at the same
    time; every rank's losses equal `smp-adapter launch`'s on one node of 4 ranks within 1e-5."""
    jobs = {"sdp2": SDP2, "pp2": PP2}
    hosts: dict[str, list[Host]] = {}
    took: dict[str, float] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            started = time.monotonic()
            with two_hosts(toolkit) as (c, s):
                hosts[name] = start_job(c, s, toolkit, tmp_path / name, jobs[name], {"steps": STEPS})
                wait_all(hosts[name], 240)
            took[name] = time.monotonic() - started
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    expected = {n: one_node_losses(tmp_path, p) for n, p in jobs.items()}
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    worst = 0.0
    for name, (leader, worker) in hosts.items():
        out = leader.output
        assert leader.proc.returncode == 0, out[-5000:]
        assert worker.proc.returncode == 0, worker.output[-5000:]
        assert "Reporting training SUCCESS" in out and (leader.base / "output/success").exists()
        assert "--host algo-1:2,algo-2:2" in out, out[-3000:]
        assert "MPI training job status file found" in worker.output, worker.output[-3000:]
        # ranks 0-1 ran on algo-1 and wrote into its /opt/ml, ranks 2-3 on algo-2 into its own
        ranks = [json.loads((h.base / f"output/data/rank{r}.json").read_text())
                 for h in (leader, worker) for r in range(h.index * PER_HOST, (h.index + 1) * PER_HOST)]
        for r, res in enumerate(ranks):
            assert res["rank"] == r and res["size"] == 4 and res["hosts"] == list(HOSTS)
            # the toolkit's mpirun -x SM_CURRENT_HOST carries the leader's value to every rank, algo-2's too
            assert res["current_host"] == "algo-1" and res["rdmav_fork_safe"] == "1"
        assert (ranks[0]["pp_size"], ranks[0]["dp_size"]) == ((2, 2) if name == "pp2" else (1, 4))
        assert (leader.base / "model/model.pt").exists()
        for r, res in enumerate(ranks):
            assert len(res["losses"]) == STEPS
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected[name][r]), rtol=0, atol=1e-5)
            worst = max(worst, max(abs(a - b) for a, b in zip(res["losses"], expected[name][r])))
    print(f"two hosts: {took}; largest difference to one node {worst:.3g}")


def _job_processes(c) -> list[str]:
    """The job's ranks and Open MPI daemons still running on either node."""
    return [d for i in range(len(HOSTS)) for d in map(netns_cluster._describe, c.pids(i))
            if "mpi4py" in d or "orted" in d or "mpirun" in d]


def test_two_hosts_toolkit_reports_a_worker_rank_failing(toolkit, tmp_path):
    """Rank 3 (on algo-2) raises UnsupportedFeatureError at step 1: Open MPI ends the job on both hosts, the
    leader's toolkit names the error in algo-1's /opt/ml/output/failure (SageMaker's FailureReason) and exits 1;
    the worker's orted and ranks end. The worker's toolkit then waits for the leader's status file, which a
    failed leader never writes; it would exit once its 2-minute check finds the leader's sshd gone: the test
    stops that container instead (a SageMaker job whose leader failed is over)."""
    with two_hosts(toolkit) as (c, s):
        started = time.monotonic()
        leader, worker = start_job(c, s, toolkit, tmp_path, SDP2, {"steps": STEPS, "fail_rank": 3})
        wait_all([leader], 180)
        took = time.monotonic() - started
        out = leader.output
        assert leader.proc.returncode == 1, out[-5000:]
        assert "Reporting training FAILURE" in out and not (leader.base / "output/success").exists()
        reason = (leader.base / "output/failure").read_text()[:1024]
        assert reason.startswith("UnsupportedFeatureError:\nExitCode "), reason
        assert "DistributedModel.join (uneven inputs) is not supported" in reason
        deadline = time.monotonic() + 30
        while _job_processes(c) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _job_processes(c) == [], _job_processes(c)
        while "Orted process exited" not in worker.output and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "Orted process exited" in worker.output, worker.output[-3000:]
        assert worker.proc.poll() is None  # in its wait for the status file
        assert not (worker.base / "output/success").exists() and not (worker.base / "output/failure").exists()
        # the container stops (SageMaker ends a job whose leader failed); its train waits on the status file and
        # does not end on SIGTERM within 20 s; the end of its PID namespace ends its sshd
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(timeout=20)
    print(f"the leader reported the failure {took:.1f} s after the start:\n{reason}")
