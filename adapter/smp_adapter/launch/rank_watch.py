"""A rank ends when its ``smp-adapter launch`` process dies, even when that process was SIGKILLed (the OOM
killer's way) and could not stop its ranks: no orphaned rank keeps a GPU, its memory and its ports.

``smp-adapter launch`` passes its identity to the job as ``SMP_ADAPTER_LAUNCH_PROCESS=<pid>:<start time>:<boot
id>`` (the start time in clock ticks since boot, /proc/<pid>/stat field 22: a pid reused by another process
does not match). At the first ``smdistributed.modelparallel`` import a rank holding that variable opens a
pidfd on the launch process and a daemon thread blocks on it (no polling: the kernel wakes it when the process
exits); then the rank SIGKILLs itself, and with it its own process group when it leads one (torchrun starts
every rank in a session of its own, so its data-loader workers go too). A variable from another machine (the
boot id differs: mpirun's ``-x`` and the deepspeed runner carry the environment to other hosts) is ignored.
A launch process already gone by the time of the import (the rank was still importing torch) ends the rank at
once. The launcher between the two (torchrun, deepspeed's launch.py, mpirun) is stopped by the launch process
itself: it starts it with ``PR_SET_PDEATHSIG`` (supervisor.py). Standard library only; Linux (elsewhere, and
on kernels without pidfd_open, the watch is not started)."""

from __future__ import annotations

import os
import select
import signal
import threading

ENV = "SMP_ADAPTER_LAUNCH_PROCESS"
_started = False


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22 (starttime), counted after "(comm)"
    except (OSError, IndexError):
        return None


def identity(pid: int | None = None) -> str | None:
    """``<pid>:<start time>:<boot id>`` of ``pid`` (default: this process); None where /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    start, boot = _start_time(pid), _boot_id()
    return f"{pid}:{start}:{boot}" if start and boot else None


def _end_this_rank() -> None:
    if os.getpgid(0) == os.getpid():  # a group of its own (torchrun's ranks): its children too
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_if_launched(environ=os.environ) -> str:
    """Start the watch when this process was launched by ``smp-adapter launch`` on this machine. Returns what
    it did ("watching", "no variable", "other machine", "unsupported"); ends the process when the launch
    process is already gone."""
    global _started
    value = environ.get(ENV)
    if not value:
        return "no variable"
    if _started:
        return "watching"
    try:
        pid_text, start, boot = value.split(":", 2)
        pid = int(pid_text)
    except ValueError:
        return "no variable"
    if boot != _boot_id():
        return "other machine"
    if not hasattr(os, "pidfd_open"):
        return "unsupported"
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _end_this_rank()  # the launch process died before this rank got here
        raise
    except OSError:  # no pidfd_open in this kernel (< 5.3), or not allowed
        return "unsupported"
    if _start_time(pid) != start:  # the pid now belongs to another process: the launch process is gone
        os.close(fd)
        _end_this_rank()
    _started = True

    def wait() -> None:
        select.select([fd], [], [])  # readable when the process exits
        _end_this_rank()

    threading.Thread(target=wait, name="smp-launch-watch", daemon=True).start()
    return "watching"
