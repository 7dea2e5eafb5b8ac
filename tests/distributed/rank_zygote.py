"""Start the ranks of one test job by forking them from a process that has already imported the
heavy libraries (torch, DeepSpeed, transformers, Megatron-core).

Why: on the 2-core CI machine each rank spends 5-8 s of CPU importing those before it runs a single
step, and a 4-rank test pays that four times over on two cores. Forked ranks share the imported
modules (copy-on-write) and start in milliseconds. Nothing in the imports starts a thread or a
process group, so forking after them is safe; smp-adapter itself is imported by each rank, after
the fork, with the rank's own environment. Used by launch_util.run_ranks only: the launch paths
users run (`smp-adapter launch`, torchrun, mpirun, the deepspeed launcher) are tested separately,
with fresh processes.

Usage: python rank_zygote.py JOB_JSON, where JOB_JSON holds {"script", "args", "cwd", "ranks": [{"env",
"log"}, ...]}. Exits with 0 if every rank did, else 1; writes {"codes": [...]} to stdout.
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


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    _preload()
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
    print(json.dumps({"codes": codes}), flush=True)
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
