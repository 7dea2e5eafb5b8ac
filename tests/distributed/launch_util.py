"""Run a training script on N local CPU processes, the way a launcher would (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, gloo), with a hard timeout so a hang fails the test instead of CI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    The ranks are forked from one process that has imported the heavy libraries (rank_zygote.py:
    on two cores that saves each rank 5-8 s of imports); each gets the environment a launcher
    would give it and runs the script as ``__main__``."""
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
                               "cwd": str(out_dir), "ranks": ranks}))
    zygote = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rank_zygote.py")), str(job)],
                              env=ranks[0]["env"], cwd=str(out_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        out, err = zygote.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(zygote.pid, 9)  # the zygote and every rank it forked
        zygote.communicate()
        raise AssertionError(f"ranks did not finish in {timeout}s:\n" + _logs(out_dir, nprocs))
    try:
        codes = json.loads(out.strip().splitlines()[-1])["codes"]
    except (IndexError, ValueError, KeyError):
        raise AssertionError(f"the rank starter failed: {out[-2000:]}{err[-3000:]}\n" + _logs(out_dir, nprocs))
    if any(codes):
        raise AssertionError(f"exit codes {codes}:\n" + _logs(out_dir, nprocs))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


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

