"""sshd in every namespaced node of netns_cluster, reached by the real ssh client: a host key and one user key
made here (ssh-keygen), one ``sshd -D`` per node listening on its address, a client configuration that knows
the host key under every node's names, and a ``bin/ssh`` that is ``ssh -F <that configuration>`` for the
programs that call plain ``ssh`` (DeepSpeed's runner, pdsh -R ssh, Open MPI's plm_rsh_agent). Everything
lives under one temporary directory that ``down()`` removes after stopping the daemons. docs/cluster.md.

    with netns_cluster.Cluster(nodes=2) as c, SshCluster(c) as ssh:
        env = ssh.env()      # PATH with bin/ssh first, PDSH_RCMD_TYPE=ssh
        c.run_in(0, ["pdsh", "-w", "n0,n1", "hostname -I"], timeout=30, env=env)

Why each setting: ``SetEnv GLOO_SOCKET_IFNAME=eth0`` is the node's own login environment (on real machines
/etc/environment or the shell's profile), since a fresh ssh session carries only what its command exports;
``StrictModes no`` because the keys sit in a temporary directory, not a home; ``UsePAM no``: no PAM stack is
needed for key logins as root, and none is configured for this sshd.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns_slurm import remove_hosts, write_hosts

PROGRAMS = ("sshd", "ssh", "ssh-keygen", "pdsh")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege separation directory
START_TIMEOUT = 15.0


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def unavailable(programs: tuple[str, ...] = PROGRAMS) -> str | None:
    missing = [name for name in programs if not _which(name)]
    if missing:
        packages = "openssh-server openssh-client" + (" pdsh" if "pdsh" in programs else "")
        return f"ssh on the nodes needs {', '.join(missing)} (apt-get install -y {packages})"
    return None


class SshError(RuntimeError):
    pass


class SshCluster:
    """One sshd per node of ``cluster`` (a netns_cluster.Cluster that is up); host names n<i> (and
    ``extra_names[i]``) resolve to node i inside every node.

    ``start_daemons=False``: only the keys, the configurations (``sshd_config(i)``, the client's) and the host
    names; whoever runs on the nodes starts sshd itself (SageMaker's toolkit starts ``/usr/sbin/sshd -D`` on
    every host), with ``sshd_argv(i)``; pdsh is then not needed."""

    def __init__(self, cluster, extra_names: dict[int, list[str]] | None = None, start_daemons: bool = True,
                 login_env: dict[str, str] | None = None):
        self.cluster = cluster
        self.login_env = {"GLOO_SOCKET_IFNAME": "eth0", **(login_env or {})}  # every session's (SetEnv)
        self.start_daemons = start_daemons
        self.names = {n.index: [f"n{n.index}", *(extra_names or {}).get(n.index, [])] for n in cluster.nodes}
        self.dir: Path | None = None
        self.daemons: list[subprocess.Popen] = []
        self.hosts_dirs: list[Path] = []
        self.made_privsep = False

    @property
    def client_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    def env(self, extra: dict | None = None) -> dict:
        """A client's environment (``extra`` and): this cluster's ssh first on PATH, pdsh told to use it."""
        env = dict(extra or {})
        path = env.get("PATH", os.environ["PATH"])
        if not path.startswith(f"{self.dir / 'bin'}{os.pathsep}"):
            path = f"{self.dir / 'bin'}{os.pathsep}{path}"
        return {**env, "PATH": path, "PDSH_RCMD_TYPE": "ssh"}

    def up(self) -> "SshCluster":
        reason = unavailable() if self.start_daemons else unavailable(("sshd", "ssh", "ssh-keygen"))
        if reason:
            raise SshError(reason)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.cluster.run_id}-ssh-"))
        try:
            self.hosts_dirs = write_hosts(self.cluster, self.names)
            self._make_keys()
            self._write_client_config()
            if not PRIVSEP_DIR.exists():
                PRIVSEP_DIR.mkdir(mode=0o755, parents=True)
                self.made_privsep = True
            for n in self.cluster.nodes:
                self._write_sshd_config(n)
            if self.start_daemons:
                for n in self.cluster.nodes:
                    self._start_sshd(n)
                self._wait_logins()
        except BaseException:
            self.down()
            raise
        return self

    def _make_keys(self) -> None:
        keygen = _which("ssh-keygen")
        for path in (self.dir / "host_ed25519", self.key):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "netns_sshd", "-f", str(path)],
                           check=True, capture_output=True, timeout=20)
        shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")
        host_pub = (self.dir / "host_ed25519.pub").read_text().split()[:2]
        known = "".join(f"{','.join([n.addr, *self.names[n.index]])} {' '.join(host_pub)}\n"
                        for n in self.cluster.nodes)
        (self.dir / "known_hosts").write_text(known)

    def _write_client_config(self) -> None:
        d = self.dir
        self.client_config.write_text(
            f"Host *\n  User root\n  IdentityFile {self.key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 10\n  LogLevel ERROR\n")
        (d / "bin").mkdir()
        wrapper = d / "bin/ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {_which('ssh')} -F {self.client_config} \"$@\"\n")
        wrapper.chmod(0o755)

    def sshd_config(self, node: int) -> Path:
        return self.dir / f"sshd_config.n{node}"

    def sshd_argv(self, node: int) -> list[str]:
        """sshd for ``node`` in the foreground, logging to stderr (run it inside the node)."""
        return [_which("sshd"), "-D", "-e", "-f", str(self.sshd_config(node))]

    def _write_sshd_config(self, node) -> None:
        d = self.dir
        self.sshd_config(node.index).write_text(
            f"ListenAddress {node.addr}\nPort 22\nHostKey {d / 'host_ed25519'}\n"
            f"PidFile {d / f'sshd.n{node.index}.pid'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"SetEnv {' '.join(f'{k}={v}' for k, v in self.login_env.items())}\nAcceptEnv LANG LC_*\nMaxStartups 100:30:200\nMaxSessions 100\n")

    def _start_sshd(self, node) -> None:
        log = open(self.dir / f"sshd.n{node.index}.log", "w")
        self.daemons.append(self.cluster.popen(node.index, self.sshd_argv(node.index),
                                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()

    def _wait_logins(self) -> None:
        """Node 0 logs into every node (bounded: sshd needs a moment to listen)."""
        deadline = time.monotonic() + START_TIMEOUT
        for n in self.cluster.nodes:
            while True:
                proc = self.run_in(0, ["ssh", f"n{n.index}", "true"], timeout=15)
                if proc.returncode == 0:
                    break
                dead = [p.args for p in self.daemons if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    logs = "".join((self.dir / f"sshd.n{i}.log").read_text()[-500:] for i in self.names)
                    raise SshError(f"ssh from node 0 to n{n.index} fails: {proc.stderr.strip()} {logs}")
                time.sleep(0.2)

    def run_in(self, node: int, argv: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        return self.cluster.run_in(node, argv, timeout=timeout, env=self.env(env))

    def popen(self, node: int, argv: list, env: dict | None = None, **kw) -> subprocess.Popen:
        return self.cluster.popen(node, argv, env=self.env(env), **kw)

    def down(self) -> None:
        """Stop every sshd (SIGTERM, SIGKILL after 5 s), remove the keys and configuration."""
        for proc in self.daemons:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.daemons = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        remove_hosts(self.hosts_dirs)
        self.hosts_dirs = []
        if self.made_privsep:
            shutil.rmtree(PRIVSEP_DIR, ignore_errors=True)
            self.made_privsep = False

    def __enter__(self) -> "SshCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


if __name__ == "__main__":
    sys.exit("use it from scripts/netns_cluster.py --ssh, or from Python (see the docstring)")
