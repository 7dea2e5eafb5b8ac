"""A real Slurm cluster on netns_cluster's nodes: one munged (a key made here), one slurmctld in node 0's
namespace, one slurmd per node (``-N n<i>``, its own spool, pid and log files, NodeAddr = the node's address),
one partition of all nodes. Everything lives under one temporary directory that ``down()`` removes after
stopping the daemons. docs/cluster.md ("Slurm").

    with netns_cluster.Cluster(nodes=2) as c, SlurmCluster(c) as slurm:
        slurm.run_in(0, ["sbatch", "--wait", "job.sh"], timeout=120)

The daemons share this machine's file system and process table but each slurmd sees only its node's network,
so what is isolated is what a cluster's network isolates: the controller and srun reach a node's slurmd at
its address over the shaped link. Settings a namespace needs and why:

* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, no cgroup plugin: every slurmd shares the
  machine's cgroup tree, and the cgroup plugins would fight over it (and need systemd's delegation);
* ``SlurmdParameters=config_overrides``: each slurmd takes its node's CPUs from slurm.conf, not from the
  (shared) hardware, so two nodes of 2 CPUs exist on a 2-core machine;
* ``JobRequeue=0``: a batch job whose node died ends (NODE_FAIL) instead of waiting to run again, so that
  ``sbatch --wait`` reports the failure as a job on real nodes without requeueing would;
* ``AuthInfo=socket=...``: this cluster's munged, not the machine's (which may run with another key);
* ``SlurmctldHost=<this host's name>(<node 0's address>)``: slurmctld checks that it runs on the host named
  there, and all namespaces share the machine's host name;
* ``MinJobAge=16``: ``sbatch --wait`` polls slurmctld after 2, 8, then 32 s sleeps, the growth stopping once a
  sleep reaches MinJobAge/2 (so a finished job's record is never purged between two polls); with the default
  300 a job that ran over 40 s is seen to end up to 32 s late. 16 keeps the poll at 8 s and stays above
  MessageTimeout (10).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo")
START_TIMEOUT = 30.0  # every node idle in sinfo


def unavailable() -> str | None:
    """Why Slurm cannot run here, in one line; None when it can (after netns_cluster.unavailable())."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if not _which(name)]
    if missing:
        return (f"Slurm needs {', '.join(missing)} (apt-get install -y slurm-wlm munge); "
                "not found on PATH or in /usr/sbin")
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


class SlurmError(RuntimeError):
    pass


def write_hosts(cluster, names: dict[int, list[str]]) -> list[Path]:
    """Give every node an /etc/hosts naming the nodes (``names``: node index -> its host names), through
    ip netns exec's per-namespace /etc (/etc/netns/<ns>/hosts, bind-mounted over /etc/hosts for the processes
    started in that namespace afterwards): a rank resolves ``n1`` (Slurm's nodelist) to node 1's address.
    Returns the directories made, for ``remove_hosts``."""
    lines = "127.0.0.1 localhost\n" + "".join(f"{cluster.nodes[i].addr} {' '.join(h)}\n" for i, h in names.items())
    made = []
    for n in cluster.nodes:
        d = NETNS_ETC / n.ns
        d.mkdir(parents=True, exist_ok=True)
        made.append(d)
        (d / "hosts").write_text(lines)
    return made


def remove_hosts(made: list[Path]) -> None:
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when empty: other runs' (or the machine's own) entries stay
    except OSError:
        pass


class SlurmCluster:
    """munged + slurmctld + one slurmd per node of ``cluster`` (a netns_cluster.Cluster that is up)."""

    def __init__(self, cluster, cpus_per_node: int = 2, slurmd_timeout: int = 10):
        self.cluster = cluster
        self.cpus = cpus_per_node
        self.slurmd_timeout = slurmd_timeout
        self.dir: Path | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.hosts_dirs: list[Path] = []

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def node_names(self) -> list[str]:
        return [f"n{n.index}" for n in self.cluster.nodes]

    def env(self, extra: dict | None = None) -> dict:
        """What a Slurm client (sbatch, srun) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf), **(extra or {})}

    # -- bring-up ------------------------------------------------------------------------------------
    def up(self) -> "SlurmCluster":
        reason = unavailable()
        if reason:
            raise SlurmError(reason)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.run_id}-slurm-"))
        try:
            self.hosts_dirs = write_hosts(self.cluster, {n.index: [f"n{n.index}"] for n in self.cluster.nodes})
            self._write_munge_key()
            self._write_conf()
            self._start_munged()
            self._start("slurmctld", 0, [_which("slurmctld"), "-D", "-f", self.conf, "-L", self.dir / "slurmctld.log"])
            for n in self.cluster.nodes:
                self._start(f"slurmd-n{n.index}", n.index,
                            [_which("slurmd"), "-D", "-N", f"n{n.index}", "-f", self.conf,
                             "-L", self.dir / f"slurmd.n{n.index}.log"])
            self._wait_idle()
        except BaseException:
            self.down()
            raise
        return self

    def _write_munge_key(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for sub in ("munge", "ctld", *(f"spool/n{n.index}" for n in self.cluster.nodes)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)  # munged refuses a world-writable directory above its socket
        os.chmod(self.dir / "munge", 0o755)

    def _write_conf(self) -> None:
        d = self.dir
        nodes = "".join(f"NodeName=n{n.index} NodeAddr={n.addr} NodeHostname=n{n.index} CPUs={self.cpus} "
                        f"State=UNKNOWN\n" for n in self.cluster.nodes)
        self.conf.write_text(
            f"ClusterName={self.cluster.run_id.replace('-', '')[:30]}\n"
            f"SlurmctldHost={socket.gethostname()}({self.cluster.nodes[0].addr})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={d / 'munge/munge.socket'}\n"
            f"StateSaveLocation={d / 'ctld'}\nSlurmdSpoolDir={d / 'spool/%n'}\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d / 'slurmd.%n.pid'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "MpiDefault=none\nSwitchType=switch/none\n"
            "SlurmdParameters=config_overrides\nReturnToService=2\nJobRequeue=0\n"
            f"SlurmdTimeout={self.slurmd_timeout}\nMessageTimeout=10\nMinJobAge=16\nInactiveLimit=0\nKillWait=5\n"
            "SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            f"{nodes}PartitionName=smp Nodes={','.join(self.node_names())} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=NO\n")

        # slurmd 22.05 loads a cgroup plugin whatever the other plugins; autodetect finds nothing under the
        # namespace's fresh /sys (ip netns exec mounts a new sysfs); v1 is only loaded, never used here
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _start_munged(self) -> None:
        d = self.dir
        argv = [_which("munged"), "--foreground", "--force", "--key-file", d / "munge.key",
                "--socket", d / "munge/munge.socket", "--pid-file", d / "munge/munged.pid",
                "--log-file", d / "munge/munged.log", "--seed-file", d / "munge/munged.seed"]
        self._start("munged", 0, argv)
        self._wait_for(lambda: (d / "munge/munge.socket").exists(), 10, "munged did not open its socket",
                       d / "munge/munged.log")

    def _start(self, name: str, node: int, argv: list) -> None:
        log = open(self.dir / f"{name}.stderr", "w")
        self.daemons[name] = self.cluster.popen(node, argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        log.close()

    def _wait_for(self, ready, timeout: float, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [f"{k} exited {p.returncode}" for k, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmError(f"{what} ({'; '.join(dead) or f'{timeout:.0f} s'}): {self._logs_tail(log)}")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            proc = self.run_in(0, ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
            states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
            return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names())

        self._wait_for(idle, START_TIMEOUT, "the Slurm nodes did not become idle")

    def _logs_tail(self, log: Path | None) -> str:
        paths = [log] if log else sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.stderr"))
        parts = []
        for p in paths:
            if p and p.exists():
                parts.append(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-8:]))
        return "\n".join(parts)

    # -- use -----------------------------------------------------------------------------------------
    def run_in(self, node: int, argv: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command in ``node``'s namespace (it reaches slurmctld at node 0's address)."""
        return self.cluster.run_in(node, argv, timeout=timeout, env=self.env(env))

    def popen(self, node: int, argv: list, env: dict | None = None, **kw) -> subprocess.Popen:
        return self.cluster.popen(node, argv, env=self.env(env), **kw)

    def kill_slurmd(self, node: int) -> None:
        """SIGKILL node ``node``'s slurmd (its slurmstepds and tasks stay, as on a real node)."""
        proc = self.daemons[f"slurmd-n{node}"]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- teardown ------------------------------------------------------------------------------------
    def down(self) -> None:
        """Stop the daemons (SIGTERM, then SIGKILL after 5 s; slurmstepds in the namespaces are left to the
        cluster's own teardown) and remove the key, configuration, spool and state directories."""
        for name in reversed(list(self.daemons)):
            proc = self.daemons[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.daemons = {}
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        remove_hosts(self.hosts_dirs)
        self.hosts_dirs = []

    def __enter__(self) -> "SlurmCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
