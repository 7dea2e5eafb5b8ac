"""How a rank that smp.init started leaves at the end of the script: every rank that ends normally
waits for the others, lets every gloo operation finish and be released, and tears the process
group down while the interpreter is still whole.

Why it takes more than ``destroy_process_group``: the engines (ZeRO-3 parameters, optimizers, the
script's own model) still hold the process groups after they are destroyed, so their gloo worker
threads live on into interpreter finalization. A worker that finishes or releases a late
asynchronous operation there (a ZeRO-3 prefetch, a reduce-scatter whose handle was dropped) must
take the GIL to free the operation's tensors; Python 3.11 ends such a thread with pthread_exit, the
unwinding meets a noexcept C++ frame, and the finished rank aborts: "terminate called without an
active exception", SIGABRT, exit status 134 after the last step had printed (seen in CI; reproduced
by tests/distributed/test_process_exit.py with asynchronous all-reduces left unwaited).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from smp_adapter.runtime.state import state

EXIT_BARRIER_S = 30.0  # a rank that died makes the exit barrier fail after this, never hang
QUIET_POLL_S = 0.02
QUIET_WAIT_S = 2.0


def leave_together_at_exit() -> None:
    """Registered by smp.init when it started the process group (not when the script did)."""
    import atexit
    import sys

    previous_hook = sys.excepthook

    def note_failure(*exc_info):  # a failed rank leaves at once: its peers' barrier times out
        state.failed = True
        previous_hook(*exc_info)

    sys.excepthook = note_failure
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    import torch.distributed as dist

    try:
        if not (state.owns_process_group and dist.is_initialized()):
            return
        if not state.failed and state.world_size > 1 and state.groups.objects is not None:
            deadline = time.monotonic() + EXIT_BARRIER_S
            dist.monitored_barrier(group=state.groups.objects, timeout=timedelta(seconds=EXIT_BARRIER_S))
            _drain_every_group(deadline)
        dist.destroy_process_group()
        _wait_for_idle_gloo_workers(time.monotonic() + QUIET_WAIT_S)
    except Exception:  # exiting anyway; never turn a clean exit into a failure
        pass


def _drain_every_group(deadline: float) -> None:
    """A barrier on every group this rank belongs to: gloo's barrier waits for all work queued on
    its group before it. Deadlock-free: all ranks create the groups in one global order (new_group
    is called by every rank), so they meet the barriers in one consistent order."""
    import torch.distributed as dist

    for group in list(dist.distributed_c10d._world.pg_map):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        dist.barrier(group=group, async_op=True).wait(timeout=timedelta(seconds=remaining))


def _wait_for_idle_gloo_workers(deadline: float) -> None:
    """After the barriers every operation has finished, but a worker may still be releasing one
    (and its tensors) right after: that release is what needs the GIL. Sleep (the GIL free) until
    no gloo worker thread has run or is runnable across one poll: a worker waiting for the GIL is
    woken when the sleep drops it, so it either runs (its on-CPU time grows) or shows as runnable.
    Linux /proc only; elsewhere one poll's sleep."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(QUIET_POLL_S)
        return
    before = _gloo_worker_activity(tasks)
    while time.monotonic() < deadline:
        time.sleep(QUIET_POLL_S)
        now = _gloo_worker_activity(tasks)
        if now == before and not any(runnable for _, runnable in now.values()):
            return
        before = now


def _gloo_worker_activity(tasks: str) -> dict[str, tuple[int, bool]]:
    """{thread id: (on-CPU nanoseconds, runnable)} for torch's gloo worker threads."""
    activity = {}
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"{tasks}/{tid}/schedstat") as f:
                on_cpu_ns = int(f.read().split()[0])
            with open(f"{tasks}/{tid}/stat") as f:
                run_state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        activity[tid] = (on_cpu_ns, run_state == "R")
    return activity
