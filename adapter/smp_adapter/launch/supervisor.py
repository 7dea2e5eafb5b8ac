"""Process supervisor of ``smp-adapter launch``: run a launcher command, stream every rank's output,
stop the whole job when a rank fails, and never hang.

* The launcher starts in its own session (``start_new_session=True``); its process group holds the
  launcher, every rank and their children, so one ``killpg`` stops everything.
* Output: the launcher's stdout+stderr come through a pipe. Rank lines are attributed to ranks by
  the launcher's own prefix (torchrun ``--tee 3``: ``[default<local rank>]:``; mpirun
  ``--tag-output``: ``[1,<rank>]<stdout>:``; srun ``--label``: ``<rank>: ``) or, for the deepspeed launcher, by tailing the
  per-rank files of ``--enable_each_rank_log`` and printing them as ``[rank R] ...``.
* Failure detection: every ~0.1 s the supervisor lists the launcher's descendants (psutil), maps
  rank processes (environment RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID, parent not itself a rank) and reads the
  exit status of a rank that has exited but is not reaped yet (a zombie: /proc/<pid>/stat). The
  first non-zero status marks the failure: the launcher gets HEAD_START (2 s) to stop the job
  itself, then the group gets SIGTERM, and SIGKILL ``grace`` seconds later.
* SIGINT/SIGTERM to the supervisor (a preemption): forwarded to the whole group at once (ranks and
  launcher), then the supervisor waits until no process of the group runs (not only the launcher:
  the deepspeed runner exits at once) or ``grace`` seconds passed, and SIGKILLs what is left. Independently, the launcher exiting (torchrun, deepspeed's launch.py and mpirun with
  orte_abort_on_non_zero_status all stop the other ranks themselves) ends the job; leftovers in
  the group are killed.
* Which rank failed: the zombie status above; else torchrun's "Root Cause" block or mpirun's
  message; else the first rank whose output holds a traceback that is not a communication error
  (a peer's death shows up on healthy ranks as "Connection closed by peer" and the like).
* Other nodes (multi-node torchrun: ``heartbeat``, node_heartbeat.py): a node found unreachable, or one whose job
  failed first, is treated as a failure seen here (the launcher's HEAD_START, then SIGTERM, SIGKILL after
  ``grace``); the report names that node. The launcher is started with PR_SET_PDEATHSIG (SIGKILL), and the
  ranks watch this process (rank_watch.py): a SIGKILL of this process leaves no rank running.
* Exit status: the failing rank's code (128 + N for a rank killed by signal N), 124 on
  ``timeout``, 125 when another node became unreachable, 128 + N when the supervisor itself got SIGINT/SIGTERM
  (forwarded to the group).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

EXIT_TIMEOUT = 124
EXIT_NODE_LOST = 125
PR_SET_PDEATHSIG = 1
PEER_REPORT_WAIT = 10.0  # seconds a node whose ranks only lost a peer waits for the other nodes' reports (ends at the
# first report; a node whose rank failed first reports once its ranks stopped: --grace, longer on a busy machine)
POLL_S = 0.1
# new rank processes and per-rank log files are looked for at most this often (they appear as the job starts);
# the known ranks' status and the open logs are read every POLL_S. Listing the job's children reads the stat
# file of every process on the machine: at every poll that was 3 % of a core beside the ranks (RESULTS §19)
SCAN_S = 1.0
HEAD_START = 2.0  # seconds the launcher gets to stop the other ranks itself after a rank failed
TAIL_LINES = 30
_PREFIX = {"torchrun": re.compile(r"^\[default(\d+)\]:"), "mpirun": re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:"),
           "srun": re.compile(r"^\s*(\d+): ")}  # srun --label
_FAILURE_BLOCK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", re.M)  # torchrun
_MPI_FAILED = (re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)"),
               re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(\d+)"))
_COMM = re.compile(r"Connection (closed|reset) by peer|Broken pipe|SMPCommError|DistBackendError|timed out|"
                   r"ProcessGroup|gloo|NCCL|connect|socket", re.I)
_TRACEBACK = "Traceback (most recent call last)"
# the last line Python prints for an exception (a syntax error has no "Traceback" line above it)
_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)(?::|$)")
_FILE_LINE = re.compile(r'^\s*File "[^"]+", line \d+')
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
_TIMEOUT = re.compile(r"timed out|timeout|Timeout", re.I)


def _dies_with_parent():
    """preexec_fn: the launcher gets SIGKILL when this process dies, even by SIGKILL (Linux; elsewhere None)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child between fork and exec

    def set_it():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    return set_it


def describe(code: int) -> str:
    return f"killed by signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
        else f"exit code {code}"


class Supervisor:
    def __init__(self, command, env, launcher: str, rank_offset: int = 0, rank_log_dir: Path | None = None,
                 timeout: float | None = None, grace: float = 20.0, out=None, heartbeat=None,
                 cause_dir: Path | None = None):
        self.command, self.env, self.launcher = list(command), dict(env), launcher
        self.cause_dir = cause_dir  # where a rank writes its cause before it raises (rank_env.CAUSE_DIR_ENV)
        self.rank_offset, self.rank_log_dir, self.timeout, self.grace = rank_offset, rank_log_dir, timeout, grace
        self.out = out or sys.stdout
        self.lock = threading.Lock()
        self.rank_lines: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=400))
        self.launcher_lines: collections.deque = collections.deque(maxlen=400)
        self.events: dict[int, int] = {}  # rank -> sequence number of its first sign of failure
        self.seq = 0
        self.pid_rank: dict[int, int] = {}  # rank processes seen
        self.exits: dict[int, int] = {}  # rank -> exit status read from its zombie
        self.failure: tuple[int, int] | None = None  # (rank, status) of the first failing rank
        self.files: dict[Path, list] = {}  # deepspeed per-rank log -> [rank, handle, partial line]
        self.old_logs: set[Path] = set()
        self.proc: subprocess.Popen | None = None
        self.signalled: int | None = None
        self.signalled_at = 0.0
        self.heartbeat = heartbeat  # node_heartbeat.NodeHeartbeat of a multi-node torchrun job, or None
        self.node_event = None  # what the heartbeat reported (another node lost or failed), once acted on
        self.summary = ""  # the report's first line (told to the other nodes)
        self.failure_at: float | None = None  # when a rank of this node was first seen failing
        self._next_scan = {"ranks": 0.0, "logs": 0.0}  # when _due looks for new rank processes / log files again

    # -- output ------------------------------------------------------------------------------------
    def emit(self, text: str, rank: int | None, shown: str | None = None) -> None:
        with self.lock:
            self.out.write((text if shown is None else shown) + "\n")
            self.out.flush()
            self.seq += 1
            if rank is None:
                self.launcher_lines.append(text)
                return
            text = _TORCH_RANK_PREFIX.sub("", text)  # torch's own "[rank0]:" before a rank's error lines
            self.rank_lines[rank].append(text)
            if _TRACEBACK in text or _ERROR_LINE.match(text):
                self.events.setdefault(rank, self.seq)

    def _read_pipe(self) -> None:
        prefix = _PREFIX.get(self.launcher)
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            m = prefix.match(line) if prefix else None
            if m:
                local = int(m.group(1))
                self.emit(line[m.end():], local + (self.rank_offset if self.launcher == "torchrun" else 0), line)
            else:
                self.emit(line, None)

    def _due(self, what: str, final: bool) -> bool:
        now = time.monotonic()
        if final or now >= self._next_scan[what]:
            self._next_scan[what] = now + SCAN_S
            return True
        return False

    def _tail_rank_logs(self, final: bool = False) -> None:
        if self.rank_log_dir is None:
            return
        for path in self.rank_log_dir.glob("*_rank*.log") if self._due("logs", final) else ():
            m = re.search(r"_rank(\d+)\.log$", path.name)
            if m and path not in self.files and path not in self.old_logs:
                self.files[path] = [int(m.group(1)), open(path, "rb"), b""]
        for entry in self.files.values():
            rank, handle, partial = entry
            data = partial + handle.read()
            *lines, entry[2] = data.split(b"\n")
            if final and entry[2]:
                lines, entry[2] = [*lines, entry[2]], b""
            for raw in lines:
                text = raw.decode("utf-8", "replace").rstrip("\r")
                self.emit(text, rank, f"[rank {rank}] {text}")

    # -- rank processes ----------------------------------------------------------------------------
    def _watch_ranks(self, final: bool = False) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil comes with deepspeed
            return
        try:
            children = sorted(psutil.Process(self.proc.pid).children(recursive=True), key=lambda p: p.pid) \
                if self._due("ranks", final) else []
        except psutil.Error:
            children = []
        for child in children:
            if child.pid in self.pid_rank:
                continue
            try:
                env = child.environ()
                rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("SLURM_PROCID")))
                if rank is not None and child.ppid() not in self.pid_rank and rank.isdigit():
                    self.pid_rank[child.pid] = int(rank)
            except psutil.Error:
                continue
        for pid, rank in self.pid_rank.items():
            if rank in self.exits:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # reaped before we saw its status: the launcher's report or the output tells
                self._event(rank)
                continue
            if fields[0] == "Z":
                status = int(fields[-1])
                self.exits[rank] = -(status & 0x7F) if status & 0x7F else status >> 8
                if self.exits[rank] != 0:
                    self._event(rank)
                    self.failure = self.failure or (rank, self.exits[rank])

    def _event(self, rank: int) -> None:
        with self.lock:
            self.seq += 1
            self.events.setdefault(rank, self.seq)

    # -- signals -----------------------------------------------------------------------------------
    def _killpg(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _on_signal(self, signum, frame) -> None:
        if self.signalled is not None:  # second Ctrl-C: no more waiting
            self._killpg(signal.SIGKILL)
        self.signalled = signum
        self.signalled_at = time.monotonic()
        # every process of the job gets it: the ranks themselves (a script that catches SIGTERM saves its
        # last checkpoint), and the launcher, which passes it to the ranks of other nodes
        self._killpg(signum)

    def _group_alive(self) -> bool:
        """Whether a process of the job's group is still running (zombies do not count: the deepspeed
        runner exits at once on SIGTERM while its ranks are still saving)."""
        pgid = self.proc.pid
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        if self.rank_log_dir is not None:
            self.old_logs = set(self.rank_log_dir.glob("*_rank*.log"))
        for old in self.cause_dir.glob("rank*.txt") if self.cause_dir is not None else ():
            old.unlink(missing_ok=True)  # an earlier job's in the same job directory
        start = time.monotonic()
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_dies_with_parent())
        reader = threading.Thread(target=self._read_pipe, daemon=True)
        reader.start()
        if self.heartbeat is not None:
            self.heartbeat.start()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        kill_at, timed_out, failed_at = None, False, None
        try:
            # after SIGINT/SIGTERM the job's processes get `grace` seconds to end by themselves (the
            # launcher may exit first), then SIGKILL
            while self.proc.poll() is None or self.signalled is not None and self._group_alive() \
                    and time.monotonic() < self.signalled_at + self.grace:
                self._tail_rank_logs()
                self._watch_ranks()
                now = time.monotonic()
                if self.timeout and not timed_out and now - start > self.timeout:
                    timed_out = True
                    print(f"smp-adapter launch: timeout: the job ran longer than {self.timeout:g} s; "
                          "stopping all ranks", file=sys.stderr, flush=True)
                if self.failure and failed_at is None:
                    failed_at = now
                if self.failure and self.failure_at is None:
                    self.failure_at = now
                event = self.heartbeat.event if self.heartbeat is not None else None
                if event is not None and self.node_event is None:
                    self.node_event = event
                    print(f"smp-adapter launch: {event.message()}; stopping this node's ranks", file=sys.stderr,
                          flush=True)
                    if failed_at is None:  # a lost node: nothing to wait for (its ranks cannot answer), stop now
                        failed_at = now - HEAD_START if event.kind == "lost" else now
                # the launcher gets HEAD_START s to stop the job itself (and say so), then the group is stopped
                if kill_at is None and (failed_at is not None and now - failed_at > HEAD_START or timed_out
                                        or self.signalled is not None):
                    if not self.signalled:
                        self._killpg(signal.SIGTERM)
                    kill_at = (self.signalled_at if self.signalled is not None else now) + self.grace
                if kill_at is not None and now > kill_at:
                    self._killpg(signal.SIGKILL)
                    kill_at = float("inf")
                time.sleep(POLL_S)
            self._watch_ranks(final=True)
        finally:
            self._killpg(signal.SIGKILL)  # leftovers (e.g. ranks of a launcher that died)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            reader.join(timeout=5)
            self._tail_rank_logs(final=True)
            for _, handle, _ in self.files.values():
                handle.close()
        if self.heartbeat is not None and self.node_event is None and self.failure is not None \
                and self.signalled is None and not self._failed_here_first(float("inf")):
            # this node's ranks only lost a peer: the node whose rank failed first says so once its job ended
            deadline = time.monotonic() + PEER_REPORT_WAIT
            while self.heartbeat.event is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self.node_event = self.heartbeat.event
        self.ended_at = time.monotonic()
        self.elapsed = self.ended_at - start
        self.stop_delay = None if failed_at is None else time.monotonic() - failed_at  # failure seen -> all gone
        code = self._outcome(timed_out)
        if self.heartbeat is not None:
            # the other nodes learn this node's end (and its cause)
            self.heartbeat.finish(code, self.summary, interrupted=self.signalled is not None)
        return code

    def _outcome(self, timed_out: bool) -> int:
        if timed_out:
            self.summary = f"the job ran longer than --timeout {self.timeout:g} s"
            return EXIT_TIMEOUT
        if self.signalled is not None:
            waited = time.monotonic() - self.signalled_at
            how = (f"every process ended by itself {waited:.1f} s later" if waited < self.grace else
                   f"what still ran {self.grace:g} s later (--grace) was killed")
            self.summary = f"interrupted ({signal.Signals(self.signalled).name})"
            print(f"smp-adapter launch: interrupted ({signal.Signals(self.signalled).name}, forwarded to every "
                  f"process of the job); {how}", file=sys.stderr)
            return 128 + self.signalled
        event = self.node_event
        if event is None or self._failed_here_first(event.at):
            return self.report(self.proc.returncode)
        self.summary = event.message()
        if event.kind == "failed":  # this node's ranks lost their connection to the failed node's (said first)
            code = self.report(self.proc.returncode)
            print(f"smp-adapter launch: {event.message()}", file=sys.stderr)
            return code or 1
        print(f"smp-adapter launch: {event.message()}; all ranks were stopped {self.ended_at - event.at:.1f} s later",
              file=sys.stderr)
        print("smp-adapter launch: once the node is reachable again, start every node's launch again and resume from "
              "the last good checkpoint", file=sys.stderr)
        return EXIT_NODE_LOST

    def _failed_here_first(self, at: float) -> bool:
        """A rank of this node failed by itself (not as a consequence of another's) before the other node's event."""
        if self.failure_at is None or self.failure_at > at:
            return False
        codes = {**self._reported_codes(), **self.exits}
        rank = self._blamed_rank(codes)
        return rank is not None and not self._secondary(rank, codes)

    def report(self, launcher_code: int) -> int:
        if launcher_code == 0 and self.failure is None:
            return 0
        codes = {**self._reported_codes(), **self.exits}
        rank = self._blamed_rank(codes)
        code = codes.get(rank)
        if code is None:  # the launcher's status: deepspeed passes a rank's -N on as 256 - N
            code = launcher_code - 256 if launcher_code > 192 and self.launcher == "deepspeed" else launcher_code
        code = code or 1
        who = f"rank {rank}" if rank is not None else "a rank"
        err = sys.stderr
        when = f" {self.stop_delay:.1f} s after the failure" if self.stop_delay is not None else ""
        lines = list(self.rank_lines.get(rank, ())) if rank is not None else \
            [t for t in self.launcher_lines if re.search(r"Error|Traceback|error", t)]
        cause = _cause(lines)
        if code == -signal.SIGTERM and cause and self.signalled is None and not self._lost_a_peer(rank):
            # it printed its error and the launcher's SIGTERM met it on its way out (every rank of a script
            # with a syntax error fails alike; the first exited before it was watched): the launcher's status
            # is the first exit's code when it says one, else Python's for an uncaught exception
            code = launcher_code if 0 < launcher_code < 128 else 1
        self.summary = f"{who} failed ({describe(code)}){f': {cause}' if cause else ''}"
        print(f"smp-adapter launch: {self.summary}; all ranks were stopped{when}", file=err)
        if rank is not None and any(_TRACEBACK in t for t in lines):
            lines = lines[max(i for i, t in enumerate(lines) if _TRACEBACK in t):]
        if lines:
            print(f"--- last {min(len(lines), TAIL_LINES)} lines of {who} ---", file=err)
            print("\n".join(lines[-TAIL_LINES:]), file=err)
        if rank is not None and self._timed_out(rank):
            print(f"smp-adapter launch: {who} was the first to report a collective timeout: another rank did not reach "
                  "the same collective within SMP_ADAPTER_TIMEOUT (stuck, much slower, or on another code path); the "
                  "ranks stopped afterwards (SIGTERM) are not the cause", file=err)
        elif rank is not None and self._lost_a_peer(rank):  # every failing rank here only lost a peer
            print(f"smp-adapter launch: {who} lost its connection to another rank, which failed first and is not "
                  "one of this launcher's: look at the output of the other nodes' launch commands", file=err)
        self._report_written_cause(rank, code, cause)
        return 128 - code if code < 0 else min(code, 255)

    def _report_written_cause(self, rank: int | None, code: int, cause: str | None) -> None:
        """The first cause a rank wrote before it raised (runtime/agreement.py), when the rank blamed did not
        print it: it was killed (a collective mismatch aborts gloo before the error is printed) or another
        rank's failure stopped it."""
        written = []
        for path in self.cause_dir.glob("rank*.txt") if self.cause_dir is not None else ():
            try:
                written.append((path.stat().st_mtime_ns, int(path.stem[len("rank"):]), path.read_text().strip()))
            except (OSError, ValueError):
                continue
        if not written:
            return
        _, first, text = min(written)
        if code >= 0 and cause and (first == rank or text.splitlines()[0][:200] in cause):
            return  # the summary quotes it already
        print(f"smp-adapter launch: rank {first} failed first, and wrote before it stopped: "
              f"{text.splitlines()[0][:1000]}", file=sys.stderr)

    def _reported_codes(self) -> dict[int, int]:
        """rank -> exit status from torchrun's failure report or mpirun's messages."""
        text, codes = "\n".join(self.launcher_lines), {}
        for pattern in (_FAILURE_BLOCK, *_MPI_FAILED):
            for m in pattern.finditer(text):
                codes.setdefault(int(m.group(1)), -int(m.group(2)) if "signal" in pattern.pattern else int(m.group(2)))
        return codes

    def _blamed_rank(self, codes: dict[int, int]) -> int | None:
        """The first rank (in the order its failure showed) whose failure is not a consequence of another's:
        killed with SIGTERM (by the launcher), or a communication error (a peer died)."""
        order = sorted(self.events, key=self.events.get) + [r for r in codes if r not in self.events]
        spoke = [r for r in order if _cause(list(self.rank_lines.get(r, ())))]  # printed an exception
        silent = [r for r in order if r not in spoke]  # only exited (stopped by the launcher, or killed)
        candidates = (
            (r for r in spoke if not self._secondary(r, codes)),
            # the first rank that reported a collective timeout: its peer hung, and the ranks stopped
            # afterwards (by SIGTERM, exiting 1 or -15 without a word) are not the cause
            (r for r in spoke if self._timed_out(r)),
            (r for r in silent if not self._secondary(r, codes)),
            (r for r in order if codes.get(r) != -signal.SIGTERM))
        for found in candidates:
            rank = next(found, None)
            if rank is not None:
                return rank
        return order[0] if order else None

    def _secondary(self, rank: int, codes: dict[int, int]) -> bool:
        return codes.get(rank) in (0, -signal.SIGTERM) or self._lost_a_peer(rank)

    def _timed_out(self, rank: int) -> bool:
        """The rank's last error is a collective timeout."""
        error = _cause(list(self.rank_lines.get(rank, ())))
        return bool(error and _TIMEOUT.search(error))

    def _lost_a_peer(self, rank: int) -> bool:
        """The rank's last error is a communication error: a peer it was talking to went away."""
        errors = [t for t in self.rank_lines.get(rank, ()) if "Error" in t or "Exception" in t]
        return bool(errors and _COMM.search(errors[-1]))


def _cause(lines: list[str]) -> str | None:
    """The last exception line of a rank's output; for a syntax error with its file and line."""
    errors = [i for i, t in enumerate(lines) if _ERROR_LINE.match(t.strip())]
    if not errors:
        return None
    i = errors[-1]
    text = lines[i].strip()
    if text.startswith(("SyntaxError", "IndentationError", "TabError")):
        where = next((lines[j].strip() for j in range(i - 1, max(-1, i - 6), -1) if _FILE_LINE.match(lines[j])), None)
        if where:
            text += f" ({where})"
    return text[:300]
