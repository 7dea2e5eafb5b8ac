"""runtime/checkpoint/integrity/spare_cores.py: a checked resume's hashing on spare cores. How many threads a rank
uses, and that the pool checks exactly the chunks a rank is due to check, against the records the
save wrote (hashed by HashingFile, a different code path), naming a damaged chunk only."""

import pytest
import torch

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import saving
from smp_adapter.runtime.checkpoint.integrity import spare_cores as spare
from smp_adapter.runtime.checkpoint.integrity.records import digest_file


@pytest.mark.parametrize("cores, local_ranks, threads", [(2, 2, 0), (2, 1, 1), (3, 2, 0), (16, 2, 2), (96, 8, 2),
                                                         (4, 8, 0)])
def test_threads_follow_the_cores_each_local_rank_has_beyond_its_own(monkeypatch, tmp_path, cores, local_ranks,
                                                                    threads):
    monkeypatch.delenv(spare.THREADS_ENV, raising=False)
    monkeypatch.setattr(spare, "CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setattr(spare.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert spare.hashing_threads(local_ranks) == threads


@pytest.mark.parametrize("cpu_max, cores", [("max 100000", 96), ("800000 100000", 8), ("50000 100000", 1),
                                            ("garbled", 96)])
def test_a_containers_cpu_quota_caps_the_cores_counted(monkeypatch, tmp_path, cpu_max, cores):
    """A pod limited to 8 CPUs on a 96-core host sees all 96 in its affinity: 8 ranks there have no
    spare core, and hashing on threads would take CPU time the ranks need."""
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    monkeypatch.setattr(spare, "CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(spare.os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    monkeypatch.delenv(spare.THREADS_ENV, raising=False)
    assert spare.usable_cores() == cores
    assert spare.hashing_threads(8) == (2 if cores == 96 else 0)


def test_the_environment_chooses_the_threads_or_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setenv(spare.THREADS_ENV, "3")
    assert spare.hashing_threads(8) == 3
    monkeypatch.setenv(spare.THREADS_ENV, "0")
    assert spare.hashing_threads(1) == 0
    for bad in ("two", "-1"):
        monkeypatch.setenv(spare.THREADS_ENV, bad)
        with pytest.raises(SMPUsageError, match=f"SMP_ADAPTER_DIGEST_THREADS='{bad}' is not a number of threads: set 0 "
                                                r"\(hash what the engine reads as it reads it\) or a positive number"):
            spare.hashing_threads(1)


def _saved(tmp_path, monkeypatch):
    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    path = tmp_path / "m.pt"
    record = saving.write_hashed(path, lambda f: torch.save({f"w{i}": torch.randn(30_000 + i) for i in range(8)}, f),
                                 "blake2b")
    assert len(record["chunks"]) == 15  # 960 KB in 64 KiB chunks: nearly four tasks' worth
    return path, record


def test_the_pool_checks_every_chunk_due_and_names_a_damaged_one(tmp_path, monkeypatch):
    path, record = _saved(tmp_path, monkeypatch)
    hasher = spare.SpareCoreHasher(2)
    whole = hasher.submit(path, "blake2b", record)
    halves = [hasher.submit(path, "blake2b", record, shared_by=(position, 2)) for position in (0, 1)]
    hasher.wait()
    assert whole.checked == {i: True for i in range(15)} and not whole.errors
    assert sorted(halves[0].checked) == list(range(0, 15, 2)) and sorted(halves[1].checked) == list(range(1, 15, 2))
    data = bytearray(path.read_bytes())
    data[9 * 65536 + 7] ^= 0x04
    path.write_bytes(bytes(data))
    assert digest_file(path, "blake2b", 65536)["chunks"][9] != record["chunks"][9]  # the damage is in chunk 9
    hasher = spare.SpareCoreHasher(2)
    damaged = hasher.submit(path, "blake2b", record)
    hasher.wait()
    assert damaged.checked == {i: i != 9 for i in range(15)}


def test_a_file_recorded_whole_is_checked_by_the_first_rank_of_those_reading_it(tmp_path, monkeypatch):
    path, record = _saved(tmp_path, monkeypatch)
    whole = digest_file(path, "blake2b", 1 << 30)
    assert "chunks" not in whole
    hasher = spare.SpareCoreHasher(1)
    first, second = (hasher.submit(path, "blake2b", whole, shared_by=(p, 2)) for p in (0, 1))
    hasher.wait()
    assert first.checked == {None: True} and second.checked == {}


def test_a_file_that_cannot_be_read_is_an_error_not_a_verdict(tmp_path, monkeypatch):
    path, record = _saved(tmp_path, monkeypatch)
    hasher = spare.SpareCoreHasher(2)
    gone = hasher.submit(tmp_path / "gone.pt", "blake2b", record)
    hasher.wait()
    assert gone.checked == {} and len(gone.errors) == 4 and all(isinstance(e, FileNotFoundError) for e in gone.errors)


class _CountingHelper:
    """One worker thread that counts what it is handed."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool, self.handed = ThreadPoolExecutor(1), 0

    def submit(self, *a):
        self.handed += 1
        return self.pool.submit(*a)


def test_a_file_hashed_beside_its_write_has_the_record_hashed_from_the_file(tmp_path, monkeypatch):
    """At the save, a tensor's bytes (a write of >= 1 MiB) are hashed on the helper thread while this
    thread writes them: the record equals the one computed from the finished file by a memory map
    (digest_file), chunk by chunk, the writes crossing chunk ends included, and the file is torch's."""
    from smp_adapter.runtime.checkpoint.integrity import hashing_io

    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    obj = {"big": torch.randn(700_000), "small": torch.randn(100), "other": torch.randn(300_001)}  # 2.8 MB + 1.2 MB
    helper = _CountingHelper()
    path = tmp_path / "m.pt"
    record = hashing_io.write_hashed(path, lambda f: torch.save(obj, f), "blake2b", helper)
    assert helper.handed == 2  # the two large tensors; the rest (headers, the pickle, "small") on this thread
    assert record == digest_file(path, "blake2b", 65536) and len(record["chunks"]) > 60
    loaded = torch.load(path, weights_only=True)
    assert all(torch.equal(loaded[k], obj[k]) for k in obj)
    helper.pool.shutdown()


def test_the_save_hashes_beside_its_writes_only_where_a_core_is_spare(monkeypatch):
    monkeypatch.setattr(spare, "_writer_helper", None)
    monkeypatch.setattr(spare, "_local_ranks", lambda: 2)
    monkeypatch.setattr(spare, "CPU_MAX", "/nonexistent/cpu.max")
    monkeypatch.delenv(spare.THREADS_ENV, raising=False)
    monkeypatch.setattr(spare.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert spare.writer_helper() is None  # two ranks on two cores: hashed on the writing thread
    monkeypatch.setattr(spare.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    helper = spare.writer_helper()
    assert helper is not None and spare.writer_helper() is helper
    monkeypatch.setenv(spare.THREADS_ENV, "0")
    assert spare.writer_helper() is None


def test_a_forked_child_starts_its_own_writer_thread(monkeypatch):
    """A process forked after a save (a data loader's worker, a rank forked from a job server) has
    none of its parent's threads: handed the parent's executor, its save would wait forever."""
    import os

    monkeypatch.setenv(spare.THREADS_ENV, "1")
    parent = spare.writer_helper()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a new executor that runs what it is handed
        helper = spare.writer_helper()
        ok = helper is not parent and helper.submit(lambda: 7).result(timeout=10) == 7
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
