"""runtime/checkpoint_digests.py on hand-made folders (no process group): what the save records, and
each problem `verify` reports. The saved checkpoints of every layout are damaged in
tests/distributed/test_checkpoint_digests.py."""

import hashlib
import json

import pytest
import torch

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime import checkpoint_digests as digests
from smp_adapter.runtime.checkpoint_files import atomic_torch_save


def _checkpoint(folder, algorithm="blake2b"):
    """A folder with two files written through the checkpoint writer, and its sealed manifest."""
    (folder / "ds").mkdir(parents=True)
    with digests.written_files() as written:
        atomic_torch_save({"w": torch.arange(1000.0)}, str(folder / "ds" / "model.pt"))
        atomic_torch_save({"step": 4}, str(folder / "user_content.pt"))
    (folder / "ds" / "unclaimed.py").write_text("# a file no rank noted: rank 0 digests it\n")
    recorded = digests.digest_written(folder, written, algorithm)
    assert sorted(recorded) == ["ds/model.pt", "user_content.pt"]
    digests.write_manifest(folder, {"tag": "t", **digests.complete(folder, recorded, algorithm)})
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
        assert digests.require_intact_everywhere(tmp_path, "resume from it", 0, 1)["tag"] == "u"


def test_files_are_split_among_ranks_by_size_the_same_on_every_rank():
    files = {f"f{i}": {"size": size} for i, size in enumerate([100, 60, 50, 10, 0])}
    split = digests.shares(files, 2)
    assert split == [["f0", "f3", "f4"], ["f1", "f2"]]  # loads 110 and 110 bytes
    assert sorted(sum(split, [])) == sorted(files) and digests.shares(dict(reversed(files.items())), 2) == split


@pytest.mark.parametrize("zipfile", [True, False])
def test_files_are_hashed_as_they_are_written(tmp_path, zipfile):
    """torch.save into the hashing file object: the recorded digest is the file's, computed by
    reading it back (torch's zip and legacy writers both only append)."""
    obj = {"w": torch.randn(600_000), "step": 3}  # 2.4 MB: several 1 MiB hash chunks in one write
    record = digests.write_hashed(tmp_path / "a.pt", lambda f: torch.save(obj, f, _use_new_zipfile_serialization=zipfile))
    assert record == digests.digest_file(tmp_path / "a.pt", digests.default_algorithm())
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=False)["w"], obj["w"])


@pytest.mark.parametrize("torch_save_engine", [True, False])
def test_noting_saves_hashes_deepspeeds_files_and_restores_the_checkpoint_engine(tmp_path, torch_save_engine):
    class Engine:  # as DeepSpeed's TorchCheckpointEngine: torch.save(state_dict, path)
        def save(self, state_dict, path):
            seen.append(type(path))
            torch.save(state_dict, path)

    engine, seen = Engine(), []
    with digests.written_files() as written, digests.noting_saves(engine, torch_save_engine):
        engine.save({"a": torch.arange(10)}, str(tmp_path / "x.pt"))
    assert "save" not in vars(engine)
    assert [path for path, _ in written] == [tmp_path / "x.pt"]
    # DeepSpeed's default engine is handed a hashing file object; any other engine its path, hashed after
    assert (seen[0] is not str) == torch_save_engine and (written[0][1] is not None) == torch_save_engine
    algorithm = digests.default_algorithm()
    assert digests.digest_written(tmp_path, written, algorithm) == {"x.pt": digests.digest_file(tmp_path / "x.pt",
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
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1)
        with pytest.raises(SMPCheckpointError) as refused:
            smp.load(str(tmp_path / "ckpt.pt"))
        assert str(refused.value).startswith(f"{tmp_path} is damaged; refusing to load it (1 problem):\n  {path}: size ")
        monkeypatch.setenv(digests.SKIP_ENV, "1")  # unchecked: torch's own error, still naming the file
        with pytest.raises(SMPCheckpointError, match=f"{path} is not a loadable checkpoint"):
            smp.load(str(tmp_path / "ckpt.pt"))
    finally:
        shutdown()
