"""The pipeline engine's torch version guards (runtime/engines/pipeline/torch_compat.py), without a
process group: which schedule is refused on which torch, and the message that says so; the receive
buffers of a stage on torch < 2.13. The guards' real runs are the support matrix's (scripts/test.sh:
test_pipeline.py's evaluation and GPT-2 cells, test_split_backward_schedules_or_their_refusal)."""

import types

import pytest
import torch

from smp_adapter.config.pipeline_schedule import EXTENSION_SCHEDULES, SMP_V1_SCHEDULES, SPLIT_BACKWARD
from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.runtime.engines.pipeline import torch_compat


@pytest.fixture
def torch_at(monkeypatch):
    def at(version: str):
        monkeypatch.setattr(torch, "__version__", version)
        torch_compat.torch_release.cache_clear()
    yield at
    torch_compat.torch_release.cache_clear()


def test_release_parses_local_builds(torch_at):
    torch_at("2.11.0+cu130")
    assert torch_compat.torch_release() == (2, 11) and torch_compat.older_than(2, 12)
    torch_at("2.13.0+cpu")
    assert not torch_compat.older_than(2, 13)


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD)
def test_split_backward_schedules_are_refused_below_2_13(torch_at, schedule):
    for version in ("2.11.0+cu130", "2.12.0"):
        torch_at(version)
        with pytest.raises(UnsupportedFeatureError, match=rf"pipeline: {schedule} needs torch >= 2\.13 "
                                                          rf"\(this is torch {version.replace('+', '.')}.*#180952"):
            torch_compat.check_schedule(schedule)
    torch_at("2.13.0")
    torch_compat.check_schedule(schedule)


@pytest.mark.parametrize("schedule", [s for s in (*SMP_V1_SCHEDULES, *EXTENSION_SCHEDULES) if s not in SPLIT_BACKWARD])
def test_the_other_schedules_run_on_the_range_floor(torch_at, schedule):
    torch_at("2.11.0")
    torch_compat.check_schedule(schedule)


class _OldStage:
    """The part of torch 2.11's traced stage that receive_integers wraps: requires_grad_(True) on every
    receive buffer when the stage has a backward."""

    def __init__(self):
        self.has_backward = True
        self.bwd_cache, self.args_recv_info = {}, {}

    def _create_act_recv_info(self):
        buffers = (torch.empty(2, 3), torch.empty(2, 3, dtype=torch.long), torch.empty(2, dtype=torch.bool))
        for b in buffers:
            if self.has_backward:
                b.requires_grad_(True)
        return tuple(types.SimpleNamespace(buffer=b) for b in buffers)

    def get_bwd_send_ops(self, chunk):  # torch 2.11 refuses a None gradient for a received value
        grads = self.bwd_cache.pop(chunk)
        if any(g is None for g in grads):
            raise RuntimeError("has gradients None and is expecting to send gradients to stage 0")
        return list(grads)


def test_integer_receive_buffers_get_no_gradient_below_2_13(torch_at):
    torch_at("2.12.0")
    stage = _OldStage()
    with pytest.raises(RuntimeError, match="floating point"):  # what torch 2.11 does unguarded
        stage._create_act_recv_info()
    torch_compat.receive_integers(stage)
    infos = stage._create_act_recv_info()
    assert [i.buffer.requires_grad for i in infos] == [True, False, False]
    assert stage.has_backward is True
    # the backward: the received float value's gradient is sent; the integer and boolean ones get zeros
    stage.args_recv_info[0] = infos
    stage.bwd_cache[0] = (torch.ones(2, 3), None, None)
    sent = stage.get_bwd_send_ops(0)
    assert torch.equal(sent[0], torch.ones(2, 3))
    assert torch.equal(sent[1], torch.zeros(2, 3, dtype=torch.long)) and torch.equal(sent[2], torch.zeros(2, dtype=torch.bool))
    stage.has_backward = False  # an evaluation schedule: no buffer wants a gradient
    assert [i.buffer.requires_grad for i in stage._create_act_recv_info()] == [False, False, False]


def test_newer_torch_stages_are_left_alone(torch_at):
    torch_at("2.13.0")
    stage = _OldStage()
    method = stage._create_act_recv_info
    torch_compat.receive_integers(stage)
    assert stage._create_act_recv_info == method


def test_forget_output_meta():
    stage = types.SimpleNamespace(_outputs_meta=(torch.empty(1),))
    torch_compat.forget_output_meta(stage)
    assert stage._outputs_meta is None
    torch_compat.forget_output_meta(types.SimpleNamespace())  # torch >= 2.12's stages have no such field
