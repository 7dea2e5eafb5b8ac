"""runtime/checkpoint/refs.py: the layout-independent index points into the files DeepSpeed's
checkpoint engine wrote. Here a stand-in engine saves with torch.save, as DeepSpeed's
TorchCheckpointEngine does; the distributed reshard tests cover the real engines."""

import pytest
import torch

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint.refs import OpenedFiles, SavedTensors


class _TorchCheckpointEngine:
    def save(self, state_dict, path):
        torch.save(state_dict, path)


class _Engine:
    def __init__(self):
        self.checkpoint_engine = _TorchCheckpointEngine()


def _save(tmp_path, engine, flat, moments):
    (tmp_path / "ds").mkdir()
    with SavedTensors(engine, tmp_path) as saved:
        engine.checkpoint_engine.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [flat]},
                                       "state": {0: {"exp_avg": moments, "step": torch.tensor(3.0)}}},
                                      str(tmp_path / "ds" / "optim.pt"))
    return saved


def test_a_view_of_a_saved_tensor_is_found_and_read_back(tmp_path):
    flat, moments = torch.arange(100, dtype=torch.float32), torch.randn(10, 5)
    saved = _save(tmp_path, _Engine(), flat, moments)
    ref = saved.locate(flat.narrow(0, 40, 25))
    assert ref == {"file": "ds/optim.pt", "path": ["optimizer_state_dict", "single_partition_of_fp32_groups", 0],
                   "offset": 40}
    assert torch.equal(OpenedFiles(tmp_path).read(ref, 25), flat[40:65])
    row = moments[7]  # a contiguous view into a 2-D tensor: offset in the flattened tensor
    ref = saved.locate(row)
    assert ref["path"] == ["state", 0, "exp_avg"] and ref["offset"] == 35
    assert torch.equal(OpenedFiles(tmp_path).read(ref, 5), row)


def test_what_deepspeed_did_not_save_is_not_found(tmp_path):
    flat = torch.arange(100, dtype=torch.float32)
    saved = _save(tmp_path, _Engine(), flat, torch.zeros(3))
    assert saved.locate(torch.arange(10, dtype=torch.float32)) is None  # another tensor
    assert saved.locate(flat.double()) is None  # a copy in another dtype
    assert saved.locate(flat.view(10, 10)[:, 0]) is None  # not contiguous
    assert saved.locate(flat[:0]) is None  # empty


def test_the_engine_save_is_restored_also_when_the_save_fails(tmp_path):
    engine = _Engine()
    with pytest.raises(RuntimeError, match="does not exist"):
        with SavedTensors(engine, tmp_path):
            engine.checkpoint_engine.save({"x": torch.zeros(2)}, str(tmp_path / "absent_dir" / "x.pt"))
    assert "save" not in vars(engine.checkpoint_engine)
    flat = torch.ones(4)
    saved = _save(tmp_path, engine, flat, torch.ones(2))  # the same engine records again afterwards
    assert "save" not in vars(engine.checkpoint_engine) and saved.locate(flat)["offset"] == 0


def test_a_missing_deepspeed_file_is_named(tmp_path):
    with pytest.raises(SMPCheckpointError, match=r"ds/optim.pt is missing: the checkpoint was copied incompletely; "
                                                 r"copy the whole <tag>_partial folder"):
        OpenedFiles(tmp_path).read({"file": "ds/optim.pt", "path": [0], "offset": 0}, 1)
