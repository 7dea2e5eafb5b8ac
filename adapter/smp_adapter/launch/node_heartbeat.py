"""Heartbeats between the ``smp-adapter launch`` processes of a multi-node torchrun job, independent of the
ranks and their collectives: a node that becomes unreachable (its machine died, its link went down, the
network partitioned) is noticed within ``--node-timeout`` seconds (default 120, ``SMP_ADAPTER_NODE_TIMEOUT``)
on every node, which then stops its ranks and exits naming that node, instead of every rank waiting out the
collective timeout (``SMP_ADAPTER_TIMEOUT``, 10 minutes). A rank that is merely busy (minutes in a checkpoint
save, a long evaluation) does not matter: the launch processes, not the ranks, exchange the heartbeats.

Topology: a star. Node 0's launch listens on ``--node-heartbeat-port`` (default: the master port + 1) on
every address; every other node's launch connects to ``--master-addr`` there, retrying until it is in (the
start is governed by torchrun's rendezvous, which waits for the same nodes). Over each connection both sides
send one JSON line every ``interval`` (timeout / 10, at most 1 s): ``hb``, and once ``done`` (its job ended:
exit code and summary). Node 0 tells the other nodes what it learns (a node lost, a node whose job failed).

A node is lost when nothing came from it for ``timeout`` seconds, or when its connection closed before it
said ``done`` (its launch process died: the kernel closes the socket). A node whose job failed (``done`` with
a non-zero code) is reported with its summary line, so every node names the first failure; one stopped by a
signal to its launch (a preemption: every node gets its own, and its ranks may still be saving) is not. Standard library
only (the launch process does not import torch)."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass

ENV_TIMEOUT = "SMP_ADAPTER_NODE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
MAX_LINE = 65536


@dataclass
class NodeEvent:
    """What one node's launch learnt about another node: ``kind`` "lost" or "failed"."""
    kind: str
    node: int
    address: str
    reason: str
    at: float

    def message(self) -> str:
        where = f"node {self.node}" + (f" ({self.address})" if self.address else "")
        if self.kind == "lost":
            return f"{where} is unreachable: {self.reason}"
        return f"{where}'s job failed first: {self.reason}"


class _Peer:
    def __init__(self, sock: socket.socket, node: int | None, address: str):
        self.sock, self.node, self.address = sock, node, address
        self.last_rx = time.monotonic()
        self.inbox = b""
        self.outbox = b""
        self.done = False


class NodeHeartbeat:
    def __init__(self, node_rank: int, nnodes: int, master_addr: str, port: int, timeout: float = DEFAULT_TIMEOUT,
                 job_key: str = ""):
        if timeout <= 0:
            raise ValueError("the node timeout must be positive")
        self.node_rank, self.nnodes, self.master_addr, self.port = node_rank, nnodes, master_addr, port
        self.timeout = float(timeout)
        self.interval = min(1.0, self.timeout / 10)
        self.job_key = job_key
        self.event: NodeEvent | None = None  # the first node lost or failed (read by the supervisor)
        self._lock = threading.Lock()
        self._peers: list[_Peer] = []
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished: tuple[int, str] | None = None
        self._done_nodes: set[int] = set()

    # -- the supervisor's side ------------------------------------------------------------------------
    def listen(self) -> None:
        """Node 0: open the heartbeat port now (OSError when it is taken)."""
        if self.node_rank == 0 and self._listener is None:
            self._listener = _listen(self.port)

    def start(self) -> None:
        self.listen()
        self._thread = threading.Thread(target=self._loop, name="smp-node-heartbeat", daemon=True)
        self._thread.start()

    def finish(self, code: int, summary: str = "", interrupted: bool = False) -> None:
        """Tell the other nodes this node's job ended (flushed for at most 2 s), then stop. ``interrupted``: it
        was stopped by a signal to its launch (a preemption, which every node gets): not a failure to report."""
        with self._lock:
            self._finished = (code, summary)
            for peer in self._peers:
                peer.outbox += _line({"t": "done", "node": self.node_rank, "code": code, "summary": summary[:2000],
                                      "interrupted": interrupted})
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            with self._lock:
                if not any(p.outbox for p in self._peers):
                    break
            time.sleep(0.02)
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for peer in self._peers:
                peer.sock.close()
            self._peers = []
            if self._listener is not None:
                self._listener.close()
                self._listener = None

    # -- the thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._beat()
        except Exception as exc:  # noqa: BLE001 - said, not silent: without the thread no node loss is noticed
            print(f"smp-adapter launch: the heartbeats with the other nodes stopped ({type(exc).__name__}: {exc}); "
                  "a lost node now ends the job only through the collective timeout", file=sys.stderr, flush=True)

    def _beat(self) -> None:
        next_beat = 0.0
        next_connect = 0.0
        connected_once = False
        while not self._stop.is_set():
            now = time.monotonic()
            if self.node_rank != 0 and not connected_once and now >= next_connect:
                next_connect = now + self.interval
                sock = _connect(self.master_addr, self.port, timeout=max(0.2, self.interval))
                if sock is not None:
                    connected_once = True
                    peer = _Peer(sock, 0, self.master_addr)
                    peer.outbox = _line({"t": "hello", "node": self.node_rank, "key": self.job_key})
                    with self._lock:
                        self._peers.append(peer)
            if now >= next_beat:
                next_beat = now + self.interval
                with self._lock:
                    for peer in self._peers:
                        if not peer.done and len(peer.outbox) < MAX_LINE:
                            peer.outbox += _line({"t": "hb"})
            self._poll(min(self.interval, 0.2))
            self._check_silence()

    def _poll(self, wait: float) -> None:
        with self._lock:
            peers = list(self._peers)
        readers = [p.sock for p in peers] + ([self._listener] if self._listener is not None else [])
        writers = [p.sock for p in peers if p.outbox]
        try:
            readable, writable, _ = select.select(readers, writers, [], wait)
        except (OSError, ValueError):  # a socket closed under us (close())
            return
        if self._listener is not None and self._listener in readable:
            try:
                sock, addr = self._listener.accept()
                sock.setblocking(False)
                address = addr[0][len("::ffff:"):] if addr[0].startswith("::ffff:") else addr[0]
                with self._lock:
                    self._peers.append(_Peer(sock, None, address))
            except OSError:
                pass
        for peer in peers:
            if peer.sock in writable:
                try:
                    sent = peer.sock.send(peer.outbox)
                    with self._lock:
                        peer.outbox = peer.outbox[sent:]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as exc:
                    self._closed(peer, f"its heartbeat connection failed ({exc.strerror or exc})")
            if peer.sock in readable:
                try:
                    data = peer.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    self._closed(peer, f"its heartbeat connection failed ({exc.strerror or exc})")
                    continue
                if not data:
                    self._closed(peer, "its launch process closed the heartbeat connection before its job ended "
                                       "(the process or its machine died)")
                    continue
                peer.last_rx = time.monotonic()
                peer.inbox += data
                while b"\n" in peer.inbox:
                    raw, peer.inbox = peer.inbox.split(b"\n", 1)
                    self._message(peer, raw)
                if len(peer.inbox) > MAX_LINE:
                    peer.inbox = b""

    def _message(self, peer: _Peer, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            kind = msg["t"]
        except (ValueError, KeyError, TypeError):
            return
        if kind == "hello":
            if msg.get("key") != self.job_key:  # another job on the same port: not one of ours
                self._drop(peer)
                return
            peer.node = int(msg.get("node", -1))
        elif kind == "done":
            peer.done = True
            node = int(msg.get("node", peer.node if peer.node is not None else -1))
            self._done_nodes.add(node)
            if int(msg.get("code", 0)) != 0 and not msg.get("interrupted"):
                self._record("failed", node, peer.address if node == peer.node else "",
                             msg.get("summary") or f"its launch exited with code {msg.get('code')}")
        elif kind in ("lost", "failed") and self.node_rank != 0:  # node 0 relays what it learnt
            node = int(msg.get("node", -1))
            if node != self.node_rank:
                self._record(kind, node, msg.get("address", ""), f"{msg.get('reason', '')} (reported by node 0)")

    def _closed(self, peer: _Peer, reason: str) -> None:
        self._drop(peer)
        if not peer.done and peer.node is not None and self._finished is None:
            self._record("lost", peer.node, peer.address, reason)

    def _drop(self, peer: _Peer) -> None:
        with self._lock:
            if peer in self._peers:
                self._peers.remove(peer)
        try:
            peer.sock.close()
        except OSError:
            pass

    def _check_silence(self) -> None:
        now = time.monotonic()
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            if peer.done or peer.node is None or self._finished is not None:
                continue
            silent = now - peer.last_rx
            if silent > self.timeout:
                self._drop(peer)
                self._record("lost", peer.node, peer.address,
                             f"no heartbeat from its launch process for {silent:.1f} s (--node-timeout {self.timeout:g}, "
                             f"{ENV_TIMEOUT}): its machine or the network between the nodes is down")

    def _record(self, kind: str, node: int, address: str, reason: str) -> None:
        with self._lock:
            if self.event is None:
                self.event = NodeEvent(kind, node, address, reason, time.monotonic())
            if self.node_rank == 0:  # tell the other nodes
                for peer in self._peers:
                    if peer.node != node and not peer.done:
                        peer.outbox += _line({"t": kind, "node": node, "address": address, "reason": reason[:2000]})


def _line(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _listen(port: int) -> socket.socket:
    """Every address, IPv4 and IPv6 where the machine has both (IPv4 alone where IPv6 is off)."""
    sock = None
    if socket.has_dualstack_ipv6():
        try:
            sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:
            sock = None
    if sock is None:
        sock = socket.create_server(("", port))
    sock.setblocking(False)
    return sock


def _connect(host: str, port: int, timeout: float) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def timeout_from(value: float | None, environ=os.environ) -> float:
    """--node-timeout, else SMP_ADAPTER_NODE_TIMEOUT, else 120 s."""
    if value is not None:
        return float(value)
    text = environ.get(ENV_TIMEOUT)
    return float(text) if text else DEFAULT_TIMEOUT
