#!/usr/bin/env python3
"""A cluster inside one machine: N "nodes", each a Linux network namespace with its own loopback and one
interface (``eth0``, address 10.213.54.<i+1>/24), joined by veth pairs to a bridge that lives in a namespace of
its own (the "switch"), every node's link shaped with ``tc tbf``; one ``smp-adapter launch --launcher torchrun
--cpu --nnodes N --node-rank i --master-addr <node 0> ...`` per node inside its namespace. Ranks of a node
talk over their node's loopback, ranks of different nodes over the shaped link. docs/cluster.md.

    sudo .venv/bin/python scripts/netns_cluster.py --nodes 2 --rate 100mbit --measure \\
        -- --nproc-per-node 2 --options '{"ddp": true, "sharded_data_parallel_degree": 4}' train.py

With ``--slurm`` (Slurm's daemons on the nodes) or ``--ssh`` (an sshd in each), everything after ``--`` is
one command run in node 0 instead (netns_services.py). Otherwise everything after ``--`` is given to every
node's ``smp-adapter launch`` (after the multi-node arguments the tool adds). Needs root, iproute2's ``ip`` and ``tc`` and network namespaces; where one is missing it says so in
one line and exits 3 (``unavailable()`` gives the same line to the tests, which skip with it).

Safety: nothing is created in the machine's own network namespace: the veth pairs are created directly
inside the namespaces (``ip link add eth0 netns NODE type veth peer name nI netns SWITCH``), the addresses
exist only there, so traffic reaches only this cluster's namespaces (and each node's own loopback). Every
name carries a per-run prefix (``smpc-<pid>-<random>-``), so runs side by side (test workers) never meet.
Everything is torn down (processes in the namespaces, qdiscs, veths, namespaces) on exit, on failure, on
Ctrl-C and SIGTERM; after a ``kill -9`` of this tool, ``netns_cluster.py --cleanup`` removes what runs whose
process is gone left behind. Every wait is bounded.

What tbf models, and what it cannot: a rate (a token bucket: ``rate``, ``burst``) and a bounded queue in front
of it (``latency``: the longest a packet may wait in the queue before it is dropped, i.e. the queue's
length). It adds no propagation delay: without ``netem`` (not in this kernel) the round trip between nodes
stays a veth's (tens of microseconds), and under load it grows only by the queueing tbf allows (up to
``latency``). Jitter, loss and reordering are not modelled either.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "smpc-"  # every namespace this tool makes: smpc-<owner pid>-<random>-<role>
SUBNET = "10.213.54"  # only ever inside this tool's namespaces (private, /24)
DEV = "eth0"  # each node's interface (the same name on every node: GLOO_SOCKET_IFNAME=eth0)
CMD_TIMEOUT = 20.0  # one ip/tc command
LAUNCH = "from smp_adapter.cli import main; raise SystemExit(main())"
PR_SET_PDEATHSIG = 1

_unavailable_cache: list = []


def _run(*argv: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class ClusterError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why a cluster cannot be built here, in one line; None when it can (probed once per process: a namespace,
    a veth pair inside it and a tbf qdisc are made and removed)."""
    if _unavailable_cache:
        return _unavailable_cache[0]
    reason = None
    if sys.platform != "linux":
        reason = "netns_cluster needs Linux network namespaces (this is not Linux)"
    elif os.geteuid() != 0:
        reason = "netns_cluster needs root (ip netns, veth and tc change the network configuration); run as root"
    elif not (shutil.which("ip") and shutil.which("tc")):
        reason = "netns_cluster needs iproute2's ip and tc on PATH (apt-get install iproute2)"
    else:
        probe = f"{PREFIX}{os.getpid()}-probe{random.randrange(16 ** 4):04x}"
        try:
            _run("ip", "netns", "add", probe)
            try:
                _run("ip", "link", "add", "p0", "netns", probe, "type", "veth", "peer", "name", "p1", "netns", probe)
                _run("ip", "-n", probe, "link", "set", "p0", "up")
                _run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit", "burst", "32kb",
                     "latency", "50ms")
            finally:
                _run("ip", "netns", "del", probe, check=False)
        except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
            reason = f"netns_cluster cannot build namespaces, veth pairs or tbf qdiscs here: {exc}"
    _unavailable_cache.append(reason)
    return reason


def _pdeathsig(sig: int = signal.SIGTERM):
    """preexec_fn: the child gets ``sig`` when this process dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def set_it():
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_it


@dataclass
class Node:
    index: int
    ns: str
    addr: str
    switch_port: str  # the veth's other end, in the switch namespace


@dataclass
class NodeRun:
    """One node's ``smp-adapter launch``: its process and its output (also written to out_dir/node<i>.out/.err)."""
    node: Node
    proc: subprocess.Popen
    stdout: list = field(default_factory=list)
    stderr: list = field(default_factory=list)
    threads: list = field(default_factory=list)

    @property
    def out(self) -> str:
        return "".join(self.stdout)

    @property
    def err(self) -> str:
        return "".join(self.stderr)


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    low = rate.lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return float(low[: -len(unit)]) * scale
    raise ClusterError(f"rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")


class Cluster:
    """``with Cluster(nodes=2, rate="100mbit") as c: runs = c.launch([...]); c.wait(runs, 300)``.

    Everything it made is removed by ``down()`` (also from ``__exit__`` and at interpreter exit)."""

    def __init__(self, nodes: int = 2, rate: str = "1gbit", latency: str = "50ms", burst: str | None = None,
                 quiet: bool = True):
        if not 2 <= nodes <= 200:
            raise ClusterError(f"--nodes {nodes}: between 2 and 200")
        self.rate, self.latency = rate, latency
        # a tbf bucket must hold at least one tick's worth of bytes at the rate; 10 ms worth, >= 16 KiB
        self.burst = burst or f"{max(16 * 1024, int(rate_bits(rate) / 8 / 100))}b"
        self.run_id = f"{PREFIX}{os.getpid()}-{random.randrange(16 ** 6):06x}"
        self.switch = f"{self.run_id}-sw"
        self.nodes = [Node(i, f"{self.run_id}-n{i}", f"{SUBNET}.{i + 1}", f"n{i}") for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.quiet = quiet
        self.strays: list[str] = []  # processes down() found in a namespace that this tool did not start directly
        self._made: list[str] = []  # namespaces created, in order
        self.inodes: set[int] = set()  # their inodes: a process inside one is found even after the names are gone
        self._up = False
        atexit.register(self.down)

    # -- bring-up ------------------------------------------------------------------------------------
    def up(self) -> "Cluster":
        reason = unavailable()
        if reason:
            raise ClusterError(reason)
        try:
            for ns in [self.switch, *(n.ns for n in self.nodes)]:
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                self.inodes.add(os.stat(f"/run/netns/{ns}").st_ino)
            sw = self.switch
            _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", sw, "link", "set", "br0", "up")
            for n in self.nodes:
                _run("ip", "link", "add", DEV, "netns", n.ns, "type", "veth", "peer", "name", n.switch_port, "netns", sw)
                _run("ip", "-n", sw, "link", "set", n.switch_port, "master", "br0")
                _run("ip", "-n", sw, "link", "set", n.switch_port, "up")
                _run("ip", "-n", n.ns, "link", "set", "lo", "up")
                _run("ip", "-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", DEV)
                _run("ip", "-n", n.ns, "link", "set", DEV, "up")
                self.set_rate(n.index, self.rate)
            self._up = True
            self._wait_reachable()
        except BaseException:
            self.down()
            raise
        return self

    def _wait_reachable(self, timeout: float = 15.0) -> None:
        """Node 0 reaches every other node (a TCP connect to a closed port answers with a reset once the
        bridge forwards: 'connection refused' means reachable); bounded."""
        code = ("import socket,sys,time\n"
                "for a in sys.argv[2:]:\n"
                " end=time.monotonic()+float(sys.argv[1])\n"
                " while True:\n"
                "  try: socket.create_connection((a,9),timeout=1).close(); break\n"
                "  except ConnectionRefusedError: break\n"
                "  except OSError:\n"
                "   if time.monotonic()>end: sys.exit('node %s unreachable' % a)\n"
                "   time.sleep(0.1)\n")
        proc = self.run_in(0, [sys.executable, "-c", code, str(timeout), *(n.addr for n in self.nodes[1:])],
                           timeout=timeout + 10)
        if proc.returncode != 0:
            raise ClusterError(f"the nodes cannot reach each other over the bridge: {proc.stderr.strip()}")

    def set_rate(self, node: int, rate: str, latency: str | None = None) -> None:
        """(Re)shape ``node``'s outgoing link: tbf rate, burst, latency (queue bound). Works mid-job."""
        burst = self.burst if rate == self.rate else f"{max(16 * 1024, int(rate_bits(rate) / 8 / 100))}b"
        _run("tc", "-n", self.nodes[node].ns, "qdisc", "replace", "dev", DEV, "root", "tbf", "rate", rate,
             "burst", burst, "latency", latency or self.latency)

    def link(self, node: int, up: bool) -> None:
        """Cut (``up=False``) or restore ``node``'s link (its eth0): a partition, both sides alive."""
        _run("ip", "-n", self.nodes[node].ns, "link", "set", DEV, "up" if up else "down")

    def tx_bytes(self, node: int) -> int:
        """Bytes ``node`` has sent over its link: the kernel's counter of its veth (/sys/class/net/eth0/statistics/
        tx_bytes inside its namespace; ip netns exec mounts that namespace's sysfs)."""
        proc = _run("ip", "netns", "exec", self.nodes[node].ns, "cat", f"/sys/class/net/{DEV}/statistics/tx_bytes")
        return int(proc.stdout)

    # -- processes -----------------------------------------------------------------------------------
    def argv_in(self, node: int, argv: list) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node].ns, *map(str, argv)]

    def node_env(self, node: int, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        # gloo binds to the address the host name resolves to, else to loopback; here the host name (shared
        # by all namespaces) resolves to 127.0.0.1, which other nodes cannot reach: name the interface
        env["GLOO_SOCKET_IFNAME"] = DEV
        env.update(extra or {})
        return env

    def run_in(self, node: int, argv: list, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = self.popen(node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            out, err = proc.communicate(timeout=10)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def popen(self, node: int, argv: list, env: dict | None = None, **kw) -> subprocess.Popen:
        if not self._up:
            raise ClusterError("the cluster is not up (use it inside 'with Cluster(...)')")
        proc = subprocess.Popen(self.argv_in(node, argv), env=self.node_env(node, env), start_new_session=True,
                                preexec_fn=_pdeathsig(), **kw)
        self.procs.append(proc)
        return proc

    def launch(self, launch_args: list, port: int = 29400, out_dir: Path | None = None, env: dict | None = None,
               echo: bool = False) -> list[NodeRun]:
        """One ``smp-adapter launch --launcher torchrun --cpu --nnodes N --node-rank i --master-addr <node 0>
        --master-port PORT LAUNCH_ARGS`` per node, in its namespace; output kept (and written to out_dir)."""
        runs = []
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            argv = [sys.executable, "-c", LAUNCH, "launch", "--launcher", "torchrun", "--cpu", "--nnodes",
                    len(self.nodes), "--node-rank", n.index, "--master-addr", self.nodes[0].addr, "--master-port", port]
            if out_dir is not None and "--job-dir" not in map(str, launch_args):
                argv += ["--job-dir", Path(out_dir) / f"node{n.index}"]
            proc = self.popen(n.index, [*argv, *launch_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
            run = NodeRun(n, proc)
            for stream, sink, name in ((proc.stdout, run.stdout, "out"), (proc.stderr, run.stderr, "err")):
                path = Path(out_dir) / f"node{n.index}.{name}" if out_dir is not None else None
                t = threading.Thread(target=_pump, args=(stream, sink, path, f"[node {n.index}] " if echo else None),
                                     daemon=True)
                t.start()
                run.threads.append(t)
            runs.append(run)
        return runs

    def wait(self, runs: list[NodeRun], timeout: float) -> bool:
        """Wait until every node's launch ended (True) or ``timeout`` s passed (False: they are killed)."""
        deadline = time.monotonic() + timeout
        ok = True
        for run in runs:
            try:
                run.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                ok = False
        if not ok:
            for run in runs:
                self._kill(run.proc)
        for run in runs:
            for t in run.threads:
                t.join(timeout=10)
        return ok

    def pids(self, node: int) -> list[int]:
        """Processes running in ``node``'s namespace now."""
        proc = _run("ip", "netns", "pids", self.nodes[node].ns, check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def members(self) -> list[str]:
        """Every process whose network namespace is one of this cluster's ("pid command"), whatever started it:
        empty once the job and the tool's own processes are gone (checked after down() by the tests)."""
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                inode = os.stat(f"/proc/{entry.name}/ns/net").st_ino
            except OSError:
                continue
            if inode in self.inodes:
                found.append(_describe(int(entry.name)))
        return found

    def namespaces(self) -> list[str]:
        """This run's namespaces that ``ip netns list`` still shows."""
        return [ns for ns in _netns_list() if ns.startswith(self.run_id)]

    def throughput(self, src: int = 1, dst: int = 0, seconds: float = 2.0) -> float:
        """TCP throughput from ``src`` to ``dst`` in Mbit/s, measured by the receiver over a bounded transfer."""
        port = 5201
        server = ("import socket,sys,time\n"
                  "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                  f"s.bind(('{self.nodes[dst].addr}',{port}));s.listen(1);s.settimeout(15);print('ready',flush=True)\n"
                  "c,_=s.accept();c.settimeout(15);n=0;t0=None\n"
                  "while True:\n"
                  " b=c.recv(1<<20)\n"
                  " if t0 is None: t0=time.monotonic()\n"
                  " if not b: break\n"
                  " n+=len(b)\n"
                  "print(n*8/(time.monotonic()-t0)/1e6)\n")
        client = ("import socket,time\n"
                  f"c=socket.create_connection(('{self.nodes[dst].addr}',{port}),timeout=15);buf=b'x'*(1<<16)\n"
                  f"end=time.monotonic()+{seconds}\n"
                  "while time.monotonic()<end: c.sendall(buf)\n"
                  "c.close()\n")
        srv = self.popen(dst, [sys.executable, "-c", server], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = srv.stdout.readline()  # bounded: the server's accept times out after 15 s
            if ready.strip() != "ready":
                raise ClusterError(f"throughput server did not start: {srv.stderr.read()[-500:]}")
            cli = self.run_in(src, [sys.executable, "-c", client], timeout=seconds + 30)
            if cli.returncode != 0:
                raise ClusterError(f"throughput client failed: {cli.stderr[-500:]}")
            out, err = srv.communicate(timeout=30)
            if srv.returncode != 0:
                raise ClusterError(f"throughput server failed: {err[-500:]}")
            return float(out.split()[-1])
        finally:
            self._kill(srv)

    # -- teardown ------------------------------------------------------------------------------------
    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def down(self) -> None:
        """Remove everything this cluster made: its processes (SIGTERM, SIGKILL 5 s later; also processes in
        its namespaces it did not start itself, listed in ``strays``), qdiscs, veths, bridge, namespaces."""
        if not self._made:
            return
        own = {p.pid for p in self.procs if p.poll() is None}
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for p in self.procs:
            self._kill(p)
        for _ in range(3):  # what is left in the namespaces (e.g. ranks whose launch died): SIGKILL, bounded
            left = [pid for ns in self._made for pid in _ns_pids(ns)]
            if not left:
                break
            for pid in left:
                if pid not in own:
                    self.strays.append(_describe(pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.3)
        for n in self.nodes:
            if n.ns in self._made:
                _run("tc", "-n", n.ns, "qdisc", "del", "dev", DEV, "root", check=False)
                _run("ip", "-n", n.ns, "link", "del", DEV, check=False)  # both ends of the pair
        errors = []
        for ns in reversed(self._made):
            proc = _run("ip", "netns", "del", ns, check=False)
            if proc.returncode != 0 and ns in _netns_list():
                errors.append(f"{ns}: {proc.stderr.strip()}")
        self._made = []
        self._up = False
        if errors:
            raise ClusterError("could not remove namespaces: " + "; ".join(errors))

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _pump(stream, sink: list, path: Path | None, prefix: str | None) -> None:
    with open(path, "w") if path else open(os.devnull, "w") as f:
        for line in iter(stream.readline, b""):
            text = line.decode("utf-8", "replace")
            sink.append(text)
            f.write(text)
            f.flush()
            if prefix is not None:
                sys.stdout.write(prefix + text)
                sys.stdout.flush()


def _ns_pids(ns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _netns_list() -> list[str]:
    proc = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} {cmd[:160]}"


def cleanup_dead_runs() -> list[str]:
    """Namespaces left by runs whose process is gone (a kill -9 of this tool): their processes killed, removed."""
    removed = []
    for ns in _netns_list():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and Path(f"/proc/{owner}").exists() and int(owner) != os.getpid():
            continue  # its run is alive
        for pid in _ns_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if ns.endswith(tuple(f"-n{i}" for i in range(200))):
            _run("ip", "-n", ns, "link", "del", DEV, check=False)
        _run("ip", "netns", "del", ns, check=False)
        # what netns_slurm/netns_sshd made for it: the nodes' /etc/netns hosts, keys, spool and state directories
        for leftover in [Path("/etc/netns") / ns, *Path(tempfile.gettempdir()).glob(f"{ns.rsplit('-', 1)[0]}-*-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        removed.append(ns)
    return removed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] [-- LAUNCH_ARGS...]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each node's link rate, tc's units (100mbit, 1gbit; default 1gbit)")
    p.add_argument("--latency", default="50ms", help="tbf latency: the longest a packet may queue (default 50ms)")
    p.add_argument("--burst", default=None, help="tbf burst (default: 10 ms at the rate, at least 16 KiB)")
    p.add_argument("--port", type=int, default=29400, help="the rendezvous port on node 0 (default 29400)")
    p.add_argument("--out", default="cluster-out", help="each node's job dir and output (node<i>.out/.err)")
    p.add_argument("--timeout", type=float, default=3600.0, help="kill the job after S seconds (default 3600)")
    p.add_argument("--measure", action="store_true", help="measure node 1 -> node 0 TCP throughput first (2 s)")
    p.add_argument("--slurm", action="store_true", help="Slurm on the nodes (netns_slurm.py); -- CMD runs in node 0")
    p.add_argument("--ssh", action="store_true", help="sshd in every node (netns_sshd.py); -- CMD runs in node 0")
    p.add_argument("--cleanup", action="store_true", help="remove what runs killed with -9 left, then exit")
    args = p.parse_args(own)
    reason = unavailable()
    if reason:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 3
    if args.cleanup:
        removed = cleanup_dead_runs()
        print(f"netns_cluster: removed {len(removed)} namespace(s) of dead runs: {' '.join(removed) or '-'}")
        return 0
    if not launch_args and not args.measure:
        p.error("give the launch arguments after '--' (or --measure)")

    def stop(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through the finally below: everything is torn down

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    cluster = Cluster(nodes=args.nodes, rate=args.rate, latency=args.latency, burst=args.burst)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        cluster.up()
        print(f"netns_cluster: {args.nodes} nodes {', '.join(n.addr for n in cluster.nodes)}, links tbf rate "
              f"{args.rate} burst {cluster.burst} latency {args.latency} (namespaces {cluster.run_id}-*)", flush=True)
        if args.measure:
            print(f"netns_cluster: measured TCP throughput node 1 -> node 0: {cluster.throughput(1, 0):.1f} Mbit/s",
                  flush=True)
        if launch_args and (args.slurm or args.ssh):
            from netns_services import run_with_services

            code = run_with_services(cluster, launch_args, args.slurm, args.ssh, args.timeout)
        elif launch_args:
            runs = cluster.launch(launch_args, port=args.port, out_dir=out, echo=True)
            finished = cluster.wait(runs, args.timeout)
            codes = [r.proc.returncode for r in runs]
            print(json.dumps({"finished": finished, "exit_codes": codes, "output": str(out)}), flush=True)
            code = 0 if finished and not any(codes) else 1
    finally:
        cluster.down()
        if cluster.strays:
            print(f"netns_cluster: killed at teardown, left in the namespaces: {cluster.strays}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
