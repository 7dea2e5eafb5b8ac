"""Traced stages run torch's generated code instead of the fx Interpreter
(surgery.run_generated_code), on a model cut by torch's own splitter, no process group.

The model names its submodules as Hugging Face BERT does (``attention.self`` and
``attention.output``): torch.export names the call of ``self`` after it, and the generated
``forward(self, ...)`` would rebind ``self`` to that call's tensor. Mutation check (measured): without
the rename, the stage's forward fails (AttributeError: ... has no attribute 'output'), as the AWS
BERT-style pipeline test did when the generated code was first switched on.
"""

import copy

import torch
from torch import nn
from torch.export.unflatten import InterpreterModule

from smp_adapter.runtime.engines.pipeline import surgery


class SelfOutputAttention(nn.Module):
    def __init__(self):
        super().__init__()
        setattr(self, "self", nn.Linear(8, 8))  # BertAttention.self (BertSelfAttention)
        self.output = nn.Linear(8, 8)

    def forward(self, x):
        return self.output(torch.tanh(getattr(self, "self")(x))) + x


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([SelfOutputAttention() for _ in range(4)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _stages(model, x):
    from torch.distributed.pipelining import SplitPoint, pipeline

    pipe = pipeline(model, (x,), {}, split_spec={"layers.2": SplitPoint.BEGINNING})
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def _interpreter_modules(stage):  # those torch calls (a ModuleList container is never finalized)
    return [m for m in stage.modules() if isinstance(m, InterpreterModule) and getattr(m, "graph_module", None)]


def test_stages_run_generated_code_with_the_interpreters_results():
    torch.manual_seed(0)
    model = Encoder()
    x = torch.randn(5, 8)
    stages = _stages(copy.deepcopy(model), x)
    renamed = [name for stage in stages for name in surgery.run_generated_code(stage)]
    # every traced attention module called a submodule named self: each had its node renamed
    assert sorted(renamed) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(not m._run_with_interpreter for stage in stages for m in _interpreter_modules(stage))

    h = x
    for stage in stages:
        h = stage(h)
    out = h[0] if isinstance(h, tuple) else h
    out.sum().backward()
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    traced = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
    for name, p in model.named_parameters():
        match = [g for n, g in traced.items() if n.replace("_", ".").endswith(name.replace("_", "."))]
        assert len(match) == 1, (name, sorted(traced))
        torch.testing.assert_close(match[0], p.grad, rtol=0, atol=0, msg=name)
    assert all("self_module" in m.graph_module.code for stage in stages for m in _interpreter_modules(stage)
               if any(n.target == "self" for n in m.graph.nodes))


def test_a_stage_without_clashing_names_is_only_switched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    from torch.distributed.pipelining import SplitPoint, pipeline

    x = torch.randn(3, 4)
    pipe = pipeline(model, (x,), {}, split_spec={"2": SplitPoint.BEGINNING})
    stage = pipe.get_stage_module(0)
    code_before = {id(m): m.graph_module.code for m in _interpreter_modules(stage)}
    assert surgery.run_generated_code(stage) == []
    assert {id(m): m.graph_module.code for m in _interpreter_modules(stage)} == code_before
    assert all(not m._run_with_interpreter for m in _interpreter_modules(stage))
