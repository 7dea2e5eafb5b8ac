"""Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (gloo on 127.0.0.1).

``fn`` must be a module-level (picklable) function. Returns the list of per-rank return values;
raises AssertionError with the failing ranks' tracebacks, or when the run exceeds ``timeout``
seconds (a hang fails the test instead of CI).
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback

import torch.multiprocessing as mp
from launch_util import free_port


def _worker(rank, world_size, port, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 110.0):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline, out, errors = time.monotonic() + timeout, {}, {}
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in out and r not in errors]
                    errors.update({r: f"timed out after {timeout:.0f} s (hang?)" for r in missing})
                continue
            (out if ok else errors)[rank] = value
            if errors:  # one rank failed: the others are likely blocked in a collective
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items())))
    return [out[r] for r in range(world_size)]
