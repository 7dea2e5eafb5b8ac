"""runtime/spare_core_hashing.py: a checked resume's hashing on spare cores. How many threads a rank
uses, and that the pool checks exactly the chunks a rank is due to check, against the records the
save wrote (hashed by HashingFile, a different code path), naming a damaged chunk only."""

import pytest
import torch

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime import checkpoint_digests as digests
from smp_adapter.runtime import spare_core_hashing as spare
from smp_adapter.runtime.digest_records import digest_file


@pytest.mark.parametrize("cores, local_ranks, threads", [(2, 2, 0), (2, 1, 1), (3, 2, 0), (16, 2, 2), (96, 8, 2),
                                                         (4, 8, 0)])
def test_threads_follow_the_cores_each_local_rank_has_beyond_its_own(monkeypatch, cores, local_ranks, threads):
    monkeypatch.delenv(spare.THREADS_ENV, raising=False)
    monkeypatch.setattr(spare.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert spare.hashing_threads(local_ranks) == threads


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
    record = digests.write_hashed(path, lambda f: torch.save({f"w{i}": torch.randn(30_000 + i) for i in range(8)}, f),
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
