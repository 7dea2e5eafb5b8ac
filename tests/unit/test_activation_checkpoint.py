"""Activation checkpointing of traced pipeline stages (runtime/activation_checkpoint.py): the model is
traced with plain segments, then each checkpointed segment's traced submodule in a stage is
checkpointed again. Checked in one process on torch's own splitter: the stage keeps fewer
activations (the segment's are recomputed) and its gradients equal the eager model's."""

import copy

import pytest
import torch
from torch import nn

from smp_adapter.runtime import activation_checkpoint as ac
from smp_adapter.runtime.engines.pipeline.surgery import checkpoint_marked


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):  # a Hugging Face-like loop over blocks
    def __init__(self):
        super().__init__()
        self.inp, self.h, self.out = nn.Linear(4, 8), nn.ModuleList(Block() for _ in range(2)), nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.h:
            x = block(x)
        return self.out(x).sum()


def _second_stage(model, x):
    from torch.distributed.pipelining import SplitPoint, pipeline

    with ac.tracing_plain():
        pipe = pipeline(model, (x,), split_spec={"h.1": SplitPoint.BEGINNING})
    assert pipe.num_stages == 2
    return pipe.get_stage_module(1)


def _saved_tensors(fn) -> int:
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count[0]


@pytest.mark.parametrize("strategy", ["each", "group_2"])
def test_traced_stage_segment_is_checkpointed_and_gradients_unchanged(strategy):
    """group_2: h.1 runs inside h.0's segment eagerly; traced, each runs on its own (a module run
    inside another fails torch's outlining: 'h.1.fc1 is not a descendant of h.0') and the stage
    boundary falls between them."""
    torch.manual_seed(0)
    model = Net()
    if strategy == "each":
        for block in model.h:
            ac.checkpoint_forward(block, preserve_rng_state=True, followers=[])
    else:
        ac.checkpoint_forward(model.h[0], preserve_rng_state=True, followers=[model.h[1]])
    x = torch.randn(3, 4)
    stage = _second_stage(model, x)
    plain = copy.deepcopy(stage)
    assert checkpoint_marked(model, stage) == ["h.1"]  # h.0 is not on this stage

    act = torch.randn(3, 8, requires_grad=True)
    act_plain = act.detach().clone().requires_grad_()
    kept = _saved_tensors(lambda: stage(act).backward())
    kept_plain = _saved_tensors(lambda: plain(act_plain).backward())
    # the segment's tensors (fc1 input, tanh, fc2 input, ...) are recomputed, not kept: only its
    # input and the head's tensors remain
    assert kept < kept_plain, (kept, kept_plain)
    assert torch.allclose(act.grad, act_plain.grad, rtol=0, atol=0)
    for (name, p), (_, q) in zip(stage.named_parameters(), plain.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
