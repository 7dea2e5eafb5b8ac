"""runtime/checkpoint/integrity/ (manifest.py, saving.py) and checkpoint/io.py on hand-made folders (no process
group): what the save records, and
each problem `verify` reports. The saved checkpoints of every layout are damaged in
tests/distributed/test_checkpoint_digests.py."""

import hashlib
import json

import pytest
import torch

from smp_adapter.cli import main
from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import resume_check as digest_check
from smp_adapter.runtime.checkpoint.integrity import saving
from smp_adapter.runtime.checkpoint.io import CheckpointIO


def _checkpoint(folder, algorithm="blake2b"):
    """A folder with two files written through the checkpoint writer, and its sealed manifest."""
    (folder / "ds").mkdir(parents=True)
    io = CheckpointIO(folder)
    io.torch_save({"w": torch.arange(1000.0)}, folder / "ds" / "model.pt")
    io.torch_save({"step": 4}, folder / "user_content.pt")
    (folder / "ds" / "unclaimed.py").write_text("# a file no rank noted: rank 0 digests it\n")
    recorded = saving.digest_written(folder, io.written, algorithm)
    assert sorted(recorded) == ["ds/model.pt", "user_content.pt"]
    saving.write_manifest(folder, {"tag": "t", **saving.complete(folder, recorded, algorithm)})
    return json.loads((folder / digests.MANIFEST).read_text())


def test_manifest_records_every_file_and_its_own_digest(tmp_path):
    manifest = _checkpoint(tmp_path)
    assert sorted(manifest["files"]) == ["ds/model.pt", "ds/unclaimed.py", "user_content.pt"]
    data = (tmp_path / "ds" / "model.pt").read_bytes()  # against hashlib itself, not our own code
    assert manifest["files"]["ds/model.pt"] == {"size": len(data),
                                                "digest": hashlib.blake2b(data, digest_size=16).hexdigest()}
    assert digests.verify(tmp_path) == (manifest, [])


def test_verify_names_each_problem(tmp_path):
    _checkpoint(tmp_path)
    data = bytearray((tmp_path / "ds" / "model.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "ds" / "model.pt").write_bytes(bytes(data))
    (tmp_path / "user_content.pt").unlink()
    (tmp_path / "ds" / "unclaimed.py").write_text("#")
    (tmp_path / "later.txt").write_text("x")
    _, problems = digests.verify(tmp_path)
    assert [str(p) for p in problems] == [
        "ds/model.pt: content differs from the save (blake2b digest): damaged bytes",
        "ds/unclaimed.py: size 1 bytes, 42 at the save: cut short or overwritten",
        "user_content.pt: missing (recorded at the save, not in the folder now)",
        "later.txt: not recorded in the manifest (added after the save)"]


def test_an_edited_manifest_is_refused_and_the_opt_out_lets_it_through(tmp_path, monkeypatch):
    manifest = _checkpoint(tmp_path)
    manifest["tag"] = "u"
    (tmp_path / digests.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SMPCheckpointError) as refused:
        digests.require_intact(tmp_path, "export it")
    assert str(refused.value).startswith(
        f"{tmp_path} is damaged; refusing to export it (1 problem):\n  {tmp_path / digests.MANIFEST}: its content "
        "does not match its own digest: edited or damaged after the save\nUse an older complete checkpoint")
    assert "SMP_ADAPTER_SKIP_CHECKPOINT_VERIFY=1" in str(refused.value)
    (tmp_path / digests.MANIFEST).write_text("{not json")
    assert "not valid JSON" in str(digests.verify(tmp_path)[1][0])
    (tmp_path / digests.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv(digests.SKIP_ENV, "1")
    digests._warned.clear()
    with pytest.warns(UserWarning, match="used without checking their digests"):
        assert digest_check.require_intact_everywhere(tmp_path, "resume from it", 0, 1)["tag"] == "u"


def test_files_are_split_among_ranks_by_size_the_same_on_every_rank():
    files = {f"f{i}": {"size": size} for i, size in enumerate([100, 60, 50, 10, 0])}
    split = digests.shares(files, 2)
    assert split == [[("f0", None), ("f3", None), ("f4", None)], [("f1", None), ("f2", None)]]  # 110 and 110 bytes
    assert digests.shares(dict(reversed(files.items())), 2) == split
    # one large file read by every rank (ZeRO 0's model file), in 4 chunks of 40 bytes: two each
    files["big"] = {"size": 150, "chunk_bytes": 40, "chunks": ["a", "b", "c", "d"]}
    split = digests.shares(files, 2)
    assert [sorted(i for n, i in share if n == "big") for share in split] == [[0, 2], [1, 3]]
    assert sorted(sum(split, []), key=str) == sorted(digests.units_of(files, sorted(files)), key=str)


def _bytes(n):
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


@pytest.mark.parametrize("size", [3 * 65536, 3 * 65536 + 5])
def test_a_large_file_records_one_digest_per_chunk(tmp_path, monkeypatch, size):
    """Chunks of SMP_ADAPTER_DIGEST_CHUNK_BYTES: hashed while written, the same digests read back,
    each the hash of its slice (against the hash library itself), and a damaged chunk named by its
    byte range."""
    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    data = _bytes(size)
    path = tmp_path / "big.bin"
    record = saving.write_hashed(path, lambda f: [f.write(data[i:i + 50_000]) for i in range(0, size, 50_000)],
                                  "blake2b")
    slices = [data[i:i + 65536] for i in range(0, size, 65536)]
    chunks = [hashlib.blake2b(c, digest_size=16).hexdigest() for c in slices]
    top = hashlib.blake2b(b"".join(bytes.fromhex(c) for c in chunks), digest_size=16).hexdigest()
    assert record == {"size": size, "digest": top, "chunk_bytes": 65536, "chunks": chunks}
    assert digests.digest_file(path, "blake2b") == record
    manifest = {digests.ALGORITHM: "blake2b", digests.FILES: {"big.bin": record}}
    assert digests.check_files(tmp_path, manifest, ["big.bin"]) == []
    damaged = bytearray(data)
    damaged[65536 + 7] ^= 1
    path.write_bytes(bytes(damaged))
    assert [str(p) for p in digests.check_files(tmp_path, manifest, ["big.bin"])] == [
        "big.bin: content differs from the save (blake2b digest of bytes 65536-131071 (chunk 2 of "
        f"{len(chunks)})): damaged bytes"]
    assert digests.check_contents(tmp_path, manifest, [("big.bin", 0), ("big.bin", 2)]) == []  # other chunks hold


def test_a_checkpoint_saved_before_chunks_is_checked_whole(tmp_path, monkeypatch):
    """A manifest from before per-chunk digests: a large file recorded by one whole-file digest
    verifies, and a flipped bit in it is still refused."""
    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    data = _bytes(5 * 65536)
    (tmp_path / "model.pt").write_bytes(data)
    old = {"size": len(data), "digest": hashlib.blake2b(data, digest_size=16).hexdigest()}
    saving.write_manifest(tmp_path, {"tag": "t", digests.ALGORITHM: "blake2b", digests.FILES: {"model.pt": old}})
    assert digests.shares({"model.pt": old}, 2) == [[("model.pt", None)], []]
    assert digests.verify(tmp_path)[1] == []
    digest_check.require_intact_everywhere(tmp_path, "resume from it", 0, 1)
    (tmp_path / "model.pt").write_bytes(data[:-1] + b"x")
    assert [str(p) for p in digests.verify(tmp_path)[1]] == [
        "model.pt: content differs from the save (blake2b digest): damaged bytes"]


@pytest.mark.parametrize("value", ["1000", "-4096", "lots"])
def test_a_chunk_size_that_cannot_be_mapped_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv(digests.CHUNK_ENV, value)
    with pytest.raises(SMPUsageError, match=f"SMP_ADAPTER_DIGEST_CHUNK_BYTES='{value}' is not a positive multiple "
                                             "of 4096 bytes: set it to one"):
        saving.write_hashed(tmp_path / "x", lambda f: f.write(b"x"))


@pytest.mark.parametrize("zipfile", [True, False])
def test_files_are_hashed_as_they_are_written(tmp_path, zipfile):
    """torch.save into the hashing file object: the recorded digest is the file's, computed by
    reading it back (torch's zip and legacy writers both only append)."""
    obj = {"w": torch.randn(600_000), "step": 3}  # 2.4 MB: several 1 MiB hash chunks in one write
    record = saving.write_hashed(tmp_path / "a.pt",
                                 lambda f: torch.save(obj, f, _use_new_zipfile_serialization=zipfile))
    assert record == digests.digest_file(tmp_path / "a.pt", digests.default_algorithm())
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=False)["w"], obj["w"])


@pytest.mark.parametrize("torch_save_engine", [True, False])
def test_io_noting_saves_hashes_deepspeeds_files_and_restores_the_checkpoint_engine(tmp_path, torch_save_engine):
    class Engine:  # as DeepSpeed's TorchCheckpointEngine: torch.save(state_dict, path)
        def save(self, state_dict, path):
            seen.append(type(path))
            torch.save(state_dict, path)

    engine, seen = Engine(), []
    io = CheckpointIO(tmp_path)
    with io.noting_saves(engine, torch_save_engine):
        engine.save({"a": torch.arange(10)}, str(tmp_path / "x.pt"))
    written = io.written
    assert "save" not in vars(engine)
    assert [path for path, _ in written] == [tmp_path / "x.pt"]
    # DeepSpeed's default engine is handed a hashing file object; any other engine its path, hashed after
    assert (seen[0] is not str) == torch_save_engine and (written[0][1] is not None) == torch_save_engine
    algorithm = digests.default_algorithm()
    assert saving.digest_written(tmp_path, written, algorithm) == {"x.pt": digests.digest_file(tmp_path / "x.pt",
                                                                                                 algorithm)}
    with pytest.raises(SMPCheckpointError, match="unknown checkpoint digest algorithm 'md4': it was written by a "
                                                 "newer smp-adapter"):
        digests.hasher("md4")


def test_smp_load_refuses_a_damaged_smp_save_file(tmp_path, monkeypatch):
    """smp.save writes <file>.smp_digest beside the file; smp.load checks it before reading."""
    import smdistributed.modelparallel.torch as smp
    from smp_adapter.runtime.init import shutdown

    for key in ("SM_HP_MP_PARAMETERS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)  # one process, as tests/unit/test_runtime_single_process.py
    shutdown()
    smp.init({})
    try:
        smp.save({"w": torch.arange(100.0)}, str(tmp_path / "ckpt.pt"), partial=True)
        path = tmp_path / "ckpt.pt_0_0"
        assert torch.equal(smp.load(str(tmp_path / "ckpt.pt"))["w"], torch.arange(100.0))
        assert main(["checkpoint", "verify", str(path)]) == 0  # one file smp.save wrote
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1)
        with pytest.raises(SMPCheckpointError) as refused:
            smp.load(str(tmp_path / "ckpt.pt"))
        assert main(["checkpoint", "verify", str(path)]) == 1
        assert str(refused.value).startswith(f"{tmp_path} is damaged; refusing to load it (1 problem):\n  {path}: size ")
        monkeypatch.setenv(digests.SKIP_ENV, "1")  # unchecked: torch's own error, still naming the file
        with pytest.raises(SMPCheckpointError, match=f"{path} is not a loadable checkpoint"):
            smp.load(str(tmp_path / "ckpt.pt"))
    finally:
        shutdown()


def test_torch_load_through_the_hashing_reader_checks_every_chunk_it_reads(tmp_path, monkeypatch):
    """A checked resume hands torch.load a reader that hashes what it reads: every chunk of a
    torch.save file is checked (the zip's directory, read first, at close), a flipped bit fails its
    chunk only, and what torch.load returns is what a load from the path returns."""
    from smp_adapter.runtime.checkpoint.integrity.hashing_io import HashingReader

    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    obj = {f"w{i}": torch.randn(20_000 + i) for i in range(6)}  # 480 KB: 8 chunks, 6 records
    path = tmp_path / "m.pt"
    record = saving.write_hashed(path, lambda f: torch.save(obj, f), "blake2b")
    with HashingReader(path, "blake2b", record) as reader:
        loaded = torch.load(reader, weights_only=True)
    assert all(torch.equal(loaded[k], obj[k]) for k in obj)
    assert reader.checked == {i: True for i in range(len(record["chunks"]))}
    data = bytearray(path.read_bytes())
    data[3 * 65536 + 100] ^= 0x10  # inside a tensor's bytes
    path.write_bytes(bytes(data))
    with HashingReader(path, "blake2b", record) as reader:
        torch.load(reader, weights_only=True)
    assert [i for i, ok in reader.checked.items() if not ok] == [3] and len(reader.checked) == len(record["chunks"])
    # a file two ranks read whole (ZeRO 0's model file): each hashes every other chunk, together all of them
    halves = []
    for position in (0, 1):
        with HashingReader(path, "blake2b", record, shared_by=(position, 2)) as reader:
            torch.load(reader, weights_only=True)
        halves.append(reader.checked)
    assert sorted(halves[0]) == list(range(0, len(record["chunks"]), 2))
    assert sorted(halves[1]) == list(range(1, len(record["chunks"]), 2))
    assert {**halves[0], **halves[1]} == {i: i != 3 for i in range(len(record["chunks"]))}


@pytest.mark.parametrize("threads", ["0", "2"])
def test_a_resume_check_covers_every_file_whether_the_engine_reads_it_or_not(tmp_path, monkeypatch, threads):
    """A resume's check in one process (start_check, Check.loading, reads through a CheckpointIO, finish): the small
    files are checked before anything is read (a damaged one is refused there), the engine's file is hashed
    while torch.load reads it (threads 0: by the reader torch.load is handed; 2: on spare cores, and torch.load
    reads the path) and not again after the load, and a file no read covered is hashed by finish: damage
    anywhere is refused."""
    from smp_adapter.runtime.checkpoint.integrity.hashing_io import HashingReader
    from smp_adapter.runtime.checkpoint.integrity.spare_cores import THREADS_ENV

    monkeypatch.setenv(digests.CHUNK_ENV, "65536")
    monkeypatch.setenv(THREADS_ENV, threads)
    (tmp_path / "ds").mkdir()
    saved = CheckpointIO(tmp_path)
    saved.torch_save({f"w{i}": torch.randn(20_000 + i) for i in range(6)}, tmp_path / "ds" / "model.pt")
    saved.torch_save({"step": 4}, tmp_path / "user_content.pt")
    recorded = saving.digest_written(tmp_path, saved.written, "blake2b")
    saving.write_manifest(tmp_path, {"tag": "t", **saving.complete(tmp_path, recorded, "blake2b")})
    model = tmp_path / "ds" / "model.pt"
    hashed_after = []
    damaged_units = digests.damaged_units

    def resume(read: bool):
        check = digest_check.start_check(tmp_path, "resume from it", 0, 1)
        assert check.checked_before == {"user_content.pt"}  # hashed already, by a plain read
        with check.loading():
            if read:
                with CheckpointIO(tmp_path, check).source(model) as source:
                    assert isinstance(source, HashingReader) if threads == "0" else source == model.resolve()
                    torch.load(source, weights_only=True)
        hashed_after.clear()
        monkeypatch.setattr(digests, "damaged_units", lambda path, *a: hashed_after.append(path.name) or
                            damaged_units(path, *a))
        try:
            return check.finish()
        finally:
            monkeypatch.setattr(digests, "damaged_units", damaged_units)

    assert resume(read=True)["tag"] == "t" and hashed_after == []  # every chunk checked while read
    assert resume(read=False)["tag"] == "t" and hashed_after == ["model.pt"]  # read by none: hashed after
    data = bytearray(model.read_bytes())
    data[3 * 65536 + 100] ^= 0x10
    model.write_bytes(bytes(data))
    for read in (True, False):
        with pytest.raises(SMPCheckpointError, match=r"model.pt: content differs from the save \(blake2b digest of "
                                                     r"bytes 196608-262143 \(chunk 4 of"):
            resume(read)
    data = bytearray((tmp_path / "user_content.pt").read_bytes())
    data[-40] ^= 0x10
    (tmp_path / "user_content.pt").write_bytes(bytes(data))
    with pytest.raises(SMPCheckpointError, match="user_content.pt: content differs"):
        digest_check.start_check(tmp_path, "resume from it", 0, 1)
