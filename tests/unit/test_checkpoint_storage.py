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
