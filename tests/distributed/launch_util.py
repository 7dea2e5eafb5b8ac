"""Run a training script on N local CPU processes, the way a launcher would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, gloo), with a hard timeout so a hang fails the test instead of CI."""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


from smp_adapter.launch.free_port import free_port  # noqa: E402  (re-exported: the tests import it from here)


def base_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "OMPI_", "RANK", "LOCAL_", "WORLD_"))}
    env.update({"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "adapter"), env.get("PYTHONPATH", "")]),
                "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra or {})
    return env


def run_ranks(script: str | Path, nprocs: int, args=(), env: dict | None = None, timeout: float = 240,
              out_dir: Path | None = None) -> list[dict]:
    """Start ``nprocs`` ranks of ``script``; return each rank's JSON result (written by the script to
    $SMP_TEST_OUT/rank<R>.json). Raises AssertionError with every rank's output on failure.

    The ranks are forked from a job server that has imported the heavy libraries once for this
    test process (rank_zygote.py: on two cores that saves each job 5 s of imports and each rank
    more); each gets the environment a launcher would give it and runs the script as ``__main__``."""
    out_dir = Path(out_dir)
    run_job(script, nprocs, args, env, timeout, out_dir)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def run_job(script: str | Path, nprocs: int, args=(), env: dict | None = None, timeout: float = 240,
            out_dir: Path | None = None, cwd: Path | None = None) -> str:
    """``run_ranks`` without the JSON results: every rank's whole output (log<R>.txt in ``out_dir``),
    rank after rank. The ranks run in ``cwd`` (default: ``out_dir``)."""
    port = free_port()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = []
    for rank in range(nprocs):
        e = base_env(env)
        e.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                  "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "SMP_TEST_OUT": str(out_dir)})
        ranks.append({"env": e, "log": str(out_dir / f"log{rank}.txt")})
    job = out_dir / "zygote_job.json"
    job.write_text(json.dumps({"script": str(Path(script).resolve()), "args": [str(a) for a in args],
                               "cwd": str(cwd or out_dir), "ranks": ranks}))
    server = _zygote_server(ranks[0]["env"])
    reply = server.run(job, timeout)
    if reply is None:
        raise AssertionError(f"ranks did not finish in {timeout}s:\n" + _logs(out_dir, nprocs))
    try:
        codes = json.loads(reply)["codes"]
    except (TypeError, ValueError, KeyError):
        starter = Path(f"{job}.out")
        out = starter.read_text() if starter.exists() else ""
        raise AssertionError(f"the rank starter failed: {out[-3000:]}\n" + _logs(out_dir, nprocs))
    if any(codes):
        raise AssertionError(f"exit codes {codes}:\n" + _logs(out_dir, nprocs))
    return "".join((out_dir / f"log{r}.txt").read_text() for r in range(nprocs))


# Variables that differ from job to job but are read only after the fork (by the rank's script,
# smp-adapter's SMP_* settings, SageMaker's SM_* ones), never by the imports the server made (torch,
# DeepSpeed, transformers, Megatron-core): jobs differing only in these share a server.
_PER_JOB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTEST_CURRENT_TEST",
            "BENCH_OUT")  # BENCH_OUT: benchmarks/_common.py's results folder, read by the rank's write_result
_PER_JOB_PREFIXES = ("SMP_", "SM_")
_servers: dict = {}
_MAX_SERVERS = 2  # each holds the imported libraries (~0.5 GB); an evicted one is simply started again


class _ZygoteServer:
    """One `rank_zygote.py --serve` process: imports done once, a job forked per request."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_zygote.py")), "--serve"],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     start_new_session=True)
        self.pending = b""  # read from the server, not yet returned as a line

    def run(self, job: Path, timeout: float) -> str | None:
        """The job's "codes" reply, or None if it ran past ``timeout`` (then its processes are killed)."""
        deadline = time.monotonic() + timeout
        self.proc.stdin.write(f"{job}\n".encode())
        started = self._line(deadline)
        if started is None or not started.startswith("started "):
            self.close()
            return None
        pid = int(started.split()[1])
        ended = self._line(deadline)
        if ended is None:
            try:
                os.killpg(pid, 9)  # the job process and every rank it forked
            except ProcessLookupError:
                pass
            self._line(time.monotonic() + 30)  # the server reaps it and answers
            return None
        return ended[len("ended "):]

    def _line(self, deadline: float) -> str | None:
        """The server's next line (unbuffered reads: select must see what is not yet read)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the server died
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip() or None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a server that will not end is killed
            os.killpg(self.proc.pid, 9)


def _zygote_server(env: dict) -> _ZygoteServer:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _PER_JOB and not k.startswith(_PER_JOB_PREFIXES)))
    server = _servers.pop(key, None)
    if server is None or not server.alive():
        server = _ZygoteServer(env)
    _servers[key] = server  # most recently used last
    while len(_servers) > _MAX_SERVERS:
        _servers.pop(next(iter(_servers))).close()
    return server


atexit.register(lambda: [server.close() for server in _servers.values()])


def _logs(out_dir: Path, nprocs: int) -> str:
    parts = []
    for r in range(nprocs):
        text = (out_dir / f"log{r}.txt").read_text()
        parts.append(f"--- rank {r} ---\n" + "\n".join(text.splitlines()[-40:]))
    return "\n".join(parts)


def write_result(obj) -> None:
    """Called by test scripts: this rank's result, with where the rank sat (``placement``)."""
    out = Path(os.environ.get("SMP_TEST_OUT", "."))
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({**obj, "placement": _placement()}))


def _placement() -> dict:
    """The rank's coordinates as smp reports them, and the launch variables it saw."""
    import smdistributed.modelparallel.torch as smp

    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                            "SM_CURRENT_HOST", "SM_HOSTS")}
    try:
        coords = {"rank": smp.rank(), "local_rank": smp.local_rank(), "tp_rank": smp.tp_rank(),
                  "pp_rank": smp.pp_rank(), "rdp_rank": smp.rdp_rank(), "dp_rank": smp.dp_rank()}
    except Exception:  # smp not initialised (a script that failed early or never called smp.init)
        coords = {}
    return {**coords, "env": seen}


MAIN = "from smp_adapter.cli import main; raise SystemExit(main())"


def cli_env(extra: dict | None = None) -> dict:
    """The environment of a user's shell running ``smp-adapter``: no rank or SageMaker variables of
    this test process, the package importable, no GPU, no DS_ACCELERATOR (launch sets it)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SM_", "OMPI_", "SLURM_", "RANK", "LOCAL_", "WORLD_", "MASTER_", "PYTHONPATH"))}
    env.update({"PYTHONPATH": str(ROOT / "adapter"), "CUDA_VISIBLE_DEVICES": ""})
    env.pop("DS_ACCELERATOR", None)
    env.update(extra or {})
    return env


def start_cli(*argv, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """``smp-adapter ARGV`` as a separate process, output captured."""
    return subprocess.Popen([sys.executable, "-c", MAIN, *map(str, argv)], cwd=cwd, env=cli_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



def parse_dry_run(stdout: str) -> tuple[dict, list[str] | None]:
    """``smp-adapter launch --dry-run``'s output: the environment it sets for the job and its command."""
    env, command = {}, None
    for line in stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            env[name] = "".join(shlex.split(value))
        elif line and not line.startswith("#"):
            assert command is None, stdout  # one command line
            command = shlex.split(line)
    return env, command


def launch_plan(*launch_args, cwd: Path) -> tuple[dict, int, Path, list[str]]:
    """What ``smp-adapter launch LAUNCH_ARGS --dry-run`` says it would do on one node: the environment
    it sets for the job, the processes, the training script and the script's arguments (what follows
    the script on the launcher's command line)."""
    proc = subprocess.run([sys.executable, "-c", MAIN, "launch", "--dry-run", *map(str, launch_args)], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, command = parse_dry_run(proc.stdout)
    nprocs = re.search(r"^# smp-adapter launch: 1 node\(s\) x (\d+) processes", proc.stdout, re.M)
    assert command is not None and nprocs is not None, proc.stdout
    script = next(i for i, arg in enumerate(command) if arg.endswith(".py") and Path(arg).is_file())
    return env, int(nprocs.group(1)), Path(command[script]), command[script + 1:]


def run_as_launched(*launch_args, cwd: Path, timeout: float = 400) -> str:
    """The job ``smp-adapter launch LAUNCH_ARGS`` (one node) would run, with the environment and script
    arguments its dry run prints, the ranks started by ``run_job`` (forked from this test process's
    job server) in ``cwd``, as the launcher starts them there: every rank's output.

    Why: a launched rank is a fresh process that spends 5-6 s of CPU importing torch, DeepSpeed,
    transformers and Megatron-core, and torchrun or DeepSpeed's launcher 2-4 s more: on the 2-core CI
    machine most of what a short job costs. Tests whose subject is the script use this; the launcher's
    own part (starting ranks, streaming output, failure handling) is run whole by test_launch.py,
    test_multinode.py, test_readme_example.py and the recipes that keep ``launch`` in test_recipes.py.
    test_launch.py checks that such a rank is given, and computes, what a launched one is and does."""
    return _as_launched(launch_args, cwd, timeout)[0]


def results_as_launched(*launch_args, cwd: Path, timeout: float = 400) -> list[dict]:
    """``run_as_launched``, returning each rank's JSON result (``write_result``) instead of the output:
    the reference that a launched job's results are compared with exactly (test_multinode.py)."""
    _, out_dir, nprocs = _as_launched(launch_args, cwd, timeout)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _as_launched(launch_args, cwd: Path, timeout: float) -> tuple[str, Path, int]:
    env, nprocs, script, script_args = launch_plan(*launch_args, cwd=cwd)
    for name in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_OUTPUT_DIR"):  # as launch creates them
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    out_dir = Path(env["SM_OUTPUT_DIR"]) / "forked-ranks"
    return run_job(script, nprocs, script_args, env=env, timeout=timeout, out_dir=out_dir, cwd=cwd), out_dir, nprocs


def shared_results(tmp_path_factory, name: str, compute) -> list[dict]:
    """``compute()``'s JSON results, computed once per test session even across pytest-xdist workers (a file
    under the session's shared temporary root, the first worker holding a lock while it computes): the
    namespaced-cluster tests compare with the same one-node reference."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-gw") else root
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # bounded by compute()'s own timeout in the holder
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
