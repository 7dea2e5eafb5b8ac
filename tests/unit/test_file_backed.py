"""runtime/file_backed.py: which tensors still hold a file's bytes, and reading their rows with pread.

The reference is the tensor itself (its values through the mapping), never the reader's own idea of the
file. The write test is the one that matters: a tensor written after loading must not be read back from
the file (that would be a silent wrong weight)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from smp_adapter.runtime.file_backed import file_spans, read_rows

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")


def _loaded(tmp_path, tensors: dict) -> dict:
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as f:  # the tensors stay on a private mapping of the file
        return {k: f.get_tensor(k) for k in f.keys()}


def test_a_mapped_tensor_is_found_in_its_file_and_its_rows_read_equal(tmp_path):
    g = torch.Generator().manual_seed(0)
    loaded = _loaded(tmp_path, {"w": torch.randn(37, 129, generator=g), "b": torch.randn(5, generator=g)})
    spans = file_spans([loaded["w"], loaded["b"]])
    if spans[0] is None:
        pytest.skip("safetensors copied the tensors here instead of mapping the file")
    assert spans[0].path.endswith("weights.safetensors") and spans[0].nbytes == 37 * 129 * 4
    for start, rows in ((0, 19), (19, 18), (36, 1), (37, 0)):
        out = torch.full((rows, 129), float("nan"))
        read_rows(spans[0], (37, 129), torch.float32, start, out)
        assert torch.equal(out, loaded["w"][start:start + rows])
    out = torch.empty(3)
    read_rows(spans[1], (5,), torch.float32, 2, out)
    assert torch.equal(out, loaded["b"][2:5])


def test_rows_convert_to_the_shards_dtype(tmp_path):
    loaded = _loaded(tmp_path, {"w": torch.randn(8, 16).to(torch.bfloat16)})
    (span,) = file_spans([loaded["w"]])
    if span is None:
        pytest.skip("safetensors copied the tensors here instead of mapping the file")
    out = torch.empty(4, 16, dtype=torch.float32)
    read_rows(span, (8, 16), torch.bfloat16, 4, out)
    assert torch.equal(out, loaded["w"][4:].float())


def test_a_tensor_written_after_loading_is_not_read_from_its_file(tmp_path):
    loaded = _loaded(tmp_path, {"w": torch.zeros(4096, 8), "v": torch.zeros(4096, 8)})
    if file_spans([loaded["w"]])[0] is None:
        pytest.skip("safetensors copied the tensors here instead of mapping the file")
    loaded["w"][2000, 3] = 1.0  # one element: its page gets a private copy, the file still says 0
    spans = file_spans([loaded["w"], loaded["v"]])
    assert spans[0] is None
    assert spans[1] is not None  # only the written tensor's pages changed


def test_tensors_not_mapped_from_a_file_have_no_span():
    view = torch.arange(12.0).view(3, 4)
    assert file_spans([torch.randn(64, 64), view.t(), torch.empty(0), torch.randn(3, device="meta"), None]) == [None] * 5
