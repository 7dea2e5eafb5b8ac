"""A checkpoint's hashing on the node's spare cores, beside the rank's own work (a leaf on the shared
floor: runtime/checkpoint/integrity/saving.py asks it for the save's helper thread,
runtime/checkpoint/integrity/resume_check.py for the resume's pool).

Two ways to hash, each as strong as the other (every byte of every chunk a rank is due to record or
check is hashed, and a check compares it before the resume returns):

* **on the rank's thread**: the save hashes each 1 MiB just before writing it
  (``hashing_io.HashingFile``); the resume hands torch.load a file object that hashes each piece
  right after it lands, still in the CPU's cache (``hashing_io.HashingReader``). The fewest CPU
  seconds, but on the rank's own thread: ~3-5 ms per 150 MB at xxh3's in-cache speed here (2-3x
  that on the H200 host of benchmarks/RESULTS.md 9.4), added to the save's and the resume's time.
* **on spare cores** (here): at the save, a helper thread hashes each tensor's bytes while the
  rank's thread writes them (``writer_helper``). At a resume, each file the engine opens is handed
  to a pool of 1-2 threads that hash its chunks through a memory map of the page cache while
  torch.load reads the same file (xxhash releases the GIL): more CPU seconds (a second pass over
  the bytes), none on the rank's thread; the resume waits only for what is not done when the load
  ends (a map hashes at 8-28 GB/s per thread, `benchmarks/checkpoint.py --hash-speed`; torch.load
  copies ~2-3 GB/s).

Which one: spare cores when every local rank has at least one core beyond its own
(``usable_cores`` // local ranks >= 2: the affinity, capped by a container's CPU quota; a GPU node
has 8-24 cores per GPU), else the rank's thread (this project's 2-core CI machine with 2 ranks: a
thread would take the other rank's core). ``SMP_ADAPTER_DIGEST_THREADS``, a number of threads (0:
the rank's thread), overrides that.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.checkpoint.integrity.records import damaged_units, due_units

THREADS_ENV = "SMP_ADAPTER_DIGEST_THREADS"
MAX_THREADS = 2  # hashing from the page cache is bound by memory bandwidth: a third thread adds little
TASK_CHUNKS = 4  # chunks per task (32 MiB at the default chunk size): a large file is shared by the threads


def hashing_threads(local_ranks: int) -> int:
    """Threads a rank hashes with during a checked resume (0: as read, ``HashingReader``)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise SMPUsageError(f"{THREADS_ENV}={raw!r} is not a number of threads: set 0 (hash what the engine reads "
                                f"as it reads it) or a positive number (hash on that many spare cores), or unset it")
        return value
    return max(0, min(MAX_THREADS, usable_cores() // max(local_ranks, 1) - 1))


CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" in microseconds, or "max <period>"


def usable_cores() -> int:
    """The cores this process may run on (its affinity), fewer where a CPU quota caps the container
    (a Kubernetes pod's CPU limit leaves the affinity at every core of the host)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota visible: the affinity stands
    return cores


_writer_helper: ThreadPoolExecutor | None = None


def writer_helper() -> ThreadPoolExecutor | None:
    """The thread a checkpoint writer hashes beside (``hashing_io.HashingFile``), where this rank
    has a spare core (``hashing_threads`` of the job's ranks on this node); None elsewhere. One per
    process, kept: a save writes files one after another."""
    global _writer_helper
    if not hashing_threads(_local_ranks()):
        return None
    if _writer_helper is None:
        _writer_helper = ThreadPoolExecutor(1, thread_name_prefix="smp-digest-write")
    return _writer_helper


def _forget_writer_helper() -> None:
    global _writer_helper
    _writer_helper = None  # a forked child has none of its parent's threads: it starts its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_writer_helper)


def _local_ranks() -> int:
    from smp_adapter.runtime.state import state

    if state.initialized:
        return state.local_size
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


class FileHashing:
    """One file's chunks (those this rank is due to check) hashed in the background. ``checked``
    ({chunk index, or None for a file recorded whole: whether it matched}, like ``HashingReader``'s)
    and ``errors`` are complete once ``SpareCoreHasher.wait`` has returned."""

    def __init__(self, path, algorithm: str, record: dict, shared_by: tuple[int, int]):
        self.path, self.algorithm, self.record = path, algorithm, record
        self.due = due_units(record, shared_by)
        self.checked: dict = {}
        self.errors: list = []

    def tasks(self) -> list[list]:
        return [self.due[i:i + TASK_CHUNKS] for i in range(0, len(self.due), TASK_CHUNKS)]

    def run(self, indices: list) -> None:
        try:
            bad = set(damaged_units(self.path, self.algorithm, self.record, indices))
        except (OSError, ValueError) as exc:  # replaced or cut while the engine read it
            self.errors.append(exc)
            return
        self.checked.update({i: i not in bad for i in indices})  # dict updates hold the GIL: safe across threads


class SpareCoreHasher:
    """The pool a checked resume hands each file to as the engine opens it (``submit``); ``wait``
    before the verdict."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="smp-digest")
        self._futures: list = []

    def submit(self, path, algorithm: str, record: dict, shared_by: tuple[int, int] = (0, 1)) -> FileHashing:
        job = FileHashing(path, algorithm, record, shared_by)
        self._futures += [self._pool.submit(job.run, task) for task in job.tasks()]
        return job

    def wait(self) -> None:
        for future in self._futures:
            future.result()
        self._pool.shutdown(wait=True)

    def cancel(self) -> None:
        """The load failed: what has not started is dropped; what runs ends on its own (it only reads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
