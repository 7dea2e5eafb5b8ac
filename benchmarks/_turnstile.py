"""Steps of separate jobs taken in turns: the jobs run side by side, but only one steps at a time.

benchmarks/launch_overhead.py compares jobs started by different launchers. Run one after the other,
two identical jobs on this 2-vCPU virtual machine differ by up to +-15 % in median step time (RESULTS
§19: the host's load drifts over the ~30 s of a job), far more than the 2 % being measured. With a
turnstile the jobs of a round start together and their steps alternate (A B B A ...): each job's rank 0
waits for its turn on a socket, every rank starts the step after a barrier and the job hands the turn
back once all its ranks have finished it. A step of one job and the neighbouring step of the other run
seconds apart, under the same load, as in benchmarks/overhead.py's in-process pairs, while each job
keeps its own launcher, environment and processes. The waiting job's ranks block (socket read, gloo
barrier); they take no CPU from the job whose turn it is.

Driver side: ``Turnstile.serve(names)`` then ``turns(order)`` per step; job side: ``Turn(address)``
around each step (``with turn: ...``).
"""

from __future__ import annotations

import socket


class Turnstile:
    """The driver: accepts one connection per job (its rank 0 says its name) and grants turns."""

    def __init__(self, timeout: float):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(timeout)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.jobs: dict[str, tuple[socket.socket, object]] = {}

    def accept(self, names, alive) -> None:
        """Wait until every job in ``names`` has connected; ``alive()`` raises when a job has exited."""
        while set(self.jobs) != set(names):
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                alive()
                raise RuntimeError(f"jobs {sorted(set(names) - set(self.jobs))} never reached their first step")
            reader = conn.makefile("r")
            self.jobs[reader.readline().strip()] = (conn, reader)

    def turn(self, name: str, alive) -> None:
        """Let job ``name`` take one step and wait until all its ranks have finished it."""
        conn, reader = self.jobs[name]
        conn.sendall(b"go\n")
        if reader.readline().strip() != "done":
            alive()
            raise RuntimeError(f"job {name} left the turnstile before finishing its step")

    def close(self) -> None:
        for conn, reader in self.jobs.values():
            reader.close()
            conn.close()
        self.server.close()


class Turn:
    """A job's side: rank 0 holds the connection; every rank enters after the turn is granted (a barrier)
    and leaves after every rank has finished (another barrier)."""

    def __init__(self, address: str | None, name: str, rank: int, dist):
        self.dist, self.conn = dist, None
        if address and rank == 0:
            host, port = address.rsplit(":", 1)
            self.conn = socket.create_connection((host, int(port)))
            self.reader = self.conn.makefile("r")
            self.conn.sendall(f"{name}\n".encode())

    def __enter__(self):
        if self.conn is not None and self.reader.readline().strip() != "go":
            raise RuntimeError("the benchmark driver closed the turnstile")
        self.dist.barrier()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.dist.barrier()
            if self.conn is not None:
                self.conn.sendall(b"done\n")
        return False
