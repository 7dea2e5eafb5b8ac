"""Start the ranks of one test job by forking them from a process that has already imported the
heavy libraries (torch, DeepSpeed, transformers, Megatron-core).

Why: on the 2-core CI machine each rank spends 5-8 s of CPU importing those before it runs a single
step, and a 4-rank test pays that four times over on two cores. Forked ranks share the imported
modules (copy-on-write) and start in milliseconds. Nothing in the imports starts a thread or a
process group, so forking after them is safe; smp-adapter itself is imported by each rank, after
the fork, with the rank's own environment. Used by launch_util.run_ranks only: the launch paths
users run (`smp-adapter launch`, torchrun, mpirun, the deepspeed launcher) are tested separately,
with fresh processes.

A JOB_JSON file holds {"script", "args", "cwd", "ranks": [{"env", "log"}, ...]}. Two ways to use it:

  python rank_zygote.py JOB_JSON   one job: exits with 0 if every rank did, else 1; writes
                                   {"codes": [...]} to stdout.
  python rank_zygote.py --serve    a job server, kept by launch_util for a pytest process's jobs: the
                                   imports are paid once per test process instead of once per job
                                   (5 s of CPU each; the distributed tier starts ~150 jobs). It reads
                                   one JOB_JSON path per line on stdin; for each it forks a job process
                                   (its own session, so a timed-out job can be killed whole) that does
                                   what the one-job form does, and answers "started PID" and then
                                   "ended {"codes": [...]}" (or "ended null" when the job process
                                   itself died) on stdout. It ends when stdin closes. The server
                                   never runs anything itself, so every job forks from the same
                                   freshly-imported state, as the one-job form does.
"""

import json
import os
import runpy
import sys
import traceback
import warnings


def _preload() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("torch", "deepspeed", "transformers", "megatron.core.tensor_parallel", "torch.distributed.pipelining"):
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - a rank that needs it will report the error itself
                pass


def _run_rank(job: dict, rank: dict) -> int:
    os.environ.clear()
    os.environ.update(rank["env"])
    fd = os.open(rank["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(job["cwd"])
    script = job["script"]
    sys.argv = [script, *job["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - report it as `python script.py` would
        traceback.print_exc()
        return 1


def _run_job(job: dict) -> list[int]:
    pids = []
    for rank in job["ranks"]:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_rank(job, rank)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    return codes


def _serve() -> int:
    _preload()
    while True:
        line = sys.stdin.readline()
        if not line:  # the test process ended
            return 0
        job_path = line.strip()
        if not job_path:
            continue
        result_path = job_path + ".codes"
        pid = os.fork()
        if pid == 0:  # the job process
            os.setsid()
            try:
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                fd = os.open(job_path + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                codes = _run_job(json.loads(open(job_path).read()))
                with open(result_path, "w") as f:
                    f.write(json.dumps({"codes": codes}))
            except BaseException:  # noqa: BLE001 - reported by the client as a starter failure
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(0)
        print(f"started {pid}", flush=True)
        os.waitpid(pid, 0)
        try:
            with open(result_path) as f:
                result = f.read()
        except OSError:
            result = "null"
        print(f"ended {result}", flush=True)


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return _serve()
    job = json.loads(open(sys.argv[1]).read())
    _preload()
    codes = _run_job(job)
    print(json.dumps({"codes": codes}), flush=True)
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
