"""Checkpoint storage failures (runtime/checkpoint/storage.py): the error names the file, the cause and
the free space, whichever writer failed (Python, torch's zip writer, safetensors); the launcher's
check of a directory before a job starts."""

import errno
import io

import pytest
import torch

from smp_adapter.runtime.checkpoint import storage


class _FullDisk(io.RawIOBase):
    """A file object whose writes fail as a full disk's do, after the first few."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def writable(self):
        return True

    def write(self, data):
        self.writes += 1
        if self.writes > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(memoryview(data))


def test_torch_save_onto_a_full_disk_is_named_with_cause_and_free_space(tmp_path):
    with pytest.raises(RuntimeError) as failed:  # torch's own report: "unexpected pos", the OSError only behind it
        torch.save({"w": torch.zeros(10_000)}, _FullDisk())
    assert storage.is_storage_failure(failed.value)
    staging = tmp_path / ".t_partial.tmp"
    staging.mkdir()
    (staging / "model_states.pt").write_bytes(b"x")
    message = str(storage.storage_failure(failed.value, tmp_path, staging))
    assert message.startswith(f"checkpoint save to {tmp_path} failed writing {staging}/model_states.pt: No space left "
                              "on device (errno ENOSPC); free space on that file system: ")
    assert "free space there or save elsewhere, then save again" in message


def test_a_rust_writers_report_is_read_for_its_errno(tmp_path):
    exc = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert storage.is_storage_failure(exc)
    assert "No space left on device (errno ENOSPC)" in str(storage.storage_failure(exc, tmp_path))
    assert not storage.is_storage_failure(ValueError("a bug, not the disk"))


def test_writable_problem_finds_an_unusable_directory_and_leaves_no_probe(tmp_path):
    assert storage.writable_problem(tmp_path / "new") is None and list((tmp_path / "new").iterdir()) == []
    (tmp_path / "file").write_text("")
    assert storage.writable_problem(tmp_path / "file" / "ckpt").startswith("cannot be written (Not a directory)")


def test_fsync_of_files_and_directories(tmp_path):
    (tmp_path / "a").write_text("x")
    storage.fsync_files([tmp_path / "a", tmp_path / "missing"])
    storage.fsync_tree(tmp_path)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class _Engine:
    """An object whose own method writes a file (DeepSpeed's engine copying its recovery script)."""

    def copy_script(self, folder):
        _enospc()

    def broken(self):
        raise ValueError("a bug, not the disk")


def test_a_failed_write_is_kept_not_raised_so_the_rank_goes_on_through_the_saves_collectives(tmp_path):
    """Issue 63: raising at the failed write left this rank out of the collectives its peers were in."""
    from smp_adapter.runtime.checkpoint.io import CheckpointIO

    io_ = CheckpointIO(tmp_path)
    assert io_.torch_save({"w": torch.zeros(3)}, tmp_path / "a.pt")  # written, noted with its digest
    assert not io_.write(tmp_path / "b.pt", _enospc)
    engine = _Engine()
    with io_.keeping_failures(engine, "copy_script"):
        assert engine.copy_script(tmp_path) is None
    assert "copy_script" not in vars(engine)  # the class's method again
    assert [p.name for p, _ in io_.written] == ["a.pt"] and io_.written[0][1] is not None
    assert [e.errno for e in io_.failures] == [errno.ENOSPC, errno.ENOSPC]
    with pytest.raises(ValueError), io_.keeping_failures(engine, "broken"):  # only storage failures are kept
        engine.broken()
    assert len(io_.failures) == 2


def test_every_rank_raises_the_agreed_failure_the_failing_one_its_own(tmp_path, monkeypatch):
    """runtime/agreement.py in one process (the collective half is the distributed tests'): the cause is written
    where the launcher reads it, the failing rank raises its own error, another rank one naming the failing rank."""
    from smp_adapter.errors import SMPCheckpointError
    from smp_adapter.runtime import agreement
    from smp_adapter.runtime.state import state

    monkeypatch.setenv(agreement.CAUSE_DIR_ENV, str(tmp_path / "causes"))
    assert agreement.agree_on_failure(None, 1) == []
    assert not (tmp_path / "causes").exists()
    failures = agreement.agree_on_failure("disk full at /ckpt", 1, SMPCheckpointError)
    assert failures == [(state.rank, "disk full at /ckpt")]
    assert (tmp_path / "causes" / f"rank{state.rank}.txt").read_text() == "SMPCheckpointError: disk full at /ckpt\n"
    with pytest.raises(SMPCheckpointError, match=r"^disk full at /ckpt$"):
        agreement.raise_agreed(failures, SMPCheckpointError)
    with pytest.raises(SMPCheckpointError, match=r"^rank 7 failed, so every rank stops here: disk full at /ckpt$"):
        agreement.raise_agreed([(7, "disk full at /ckpt")], SMPCheckpointError)
    agreement.raise_agreed([], SMPCheckpointError)  # nobody failed: nothing raised


def test_naming_the_failed_file_survives_a_file_removed_meanwhile(tmp_path, monkeypatch):
    """Another rank's failed atomic write removes its temporary file while this rank looks for the newest file."""
    staging = tmp_path / ".t_partial.tmp"
    staging.mkdir()
    (staging / "kept.pt").write_bytes(b"x")
    (staging / ".gone.pt.tmp.1").write_bytes(b"x")
    (staging / ".gone.pt.tmp.1").unlink()  # after it was listed and seen to be a file: its stat fails
    is_file = type(staging).is_file
    monkeypatch.setattr(type(staging), "is_file", lambda self: self.name == ".gone.pt.tmp.1" or is_file(self))
    monkeypatch.setattr(type(staging), "rglob", lambda self, pattern: iter([staging / ".gone.pt.tmp.1",
                                                                            staging / "kept.pt"]))
    message = str(storage.storage_failure(OSError(errno.ENOSPC, "No space left on device"), tmp_path, staging))
    assert f"failed writing {staging}/kept.pt: No space left on device" in message


def test_a_copy_that_fills_the_disk_is_named_by_the_file_it_wrote_not_its_source(tmp_path):
    # shutil.copyfile's sendfile sets filename (the source) and filename2 (the destination) on ENOSPC
    exc = OSError(errno.ENOSPC, "No space left on device", "/site-packages/deepspeed/utils/zero_to_fp32.py", None,
                  str(tmp_path / ".t_partial.tmp/zero_to_fp32.py"))
    message = str(storage.storage_failure(exc, tmp_path))
    assert f"failed writing {tmp_path}/.t_partial.tmp/zero_to_fp32.py: No space left on device" in message
