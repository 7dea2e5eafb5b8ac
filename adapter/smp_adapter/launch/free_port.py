"""A free local port for a job's rendezvous (rank 0's TCPStore), the one home of that rule: the
launcher (`smp-adapter launch` on one node), a one-process job's `smp.init`, the tests' and the
benchmarks' rank starters all take theirs here. Standard library only: cheap to import anywhere.

The port is picked below the kernel's ephemeral range. A port that bind(0) hands out comes from that
range, and so does the local port of every outgoing connection and of every gloo listener that jobs
beside this one open; the port is free when picked but rank 0 binds it seconds later (after importing
torch), and in that moment such a connection took it (seen in CI, twice: rank 0 failed with
EADDRINUSE, or rank 1 connected to the stranger, "Connection reset by peer", and retried until the
job's timeout). Below the range only another job's pick can meet it."""

from __future__ import annotations

import os
import random
import socket
import time

_BELOW_RANGE = 12_000  # how far below the ephemeral range to look
_EPHEMERAL_LOW = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now, below the ephemeral range where one is free there."""
    try:
        with open(_EPHEMERAL_LOW) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; other systems: the same region is rarely handed out either
    picker = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(200):
        port = picker.randrange(max(1024, low - _BELOW_RANGE), low)
        if _bindable(host, port):
            return port
    with socket.socket() as s:  # nothing free below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
