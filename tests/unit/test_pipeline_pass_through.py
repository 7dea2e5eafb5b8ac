"""Values read past the next stage, threaded through the stages in between
(runtime/engines/pipeline/pass_through.py), on a model cut by torch's own splitter, no process group.

The model: four Linear layers; the first layer's output h0 is read by the stages of layers 1, 2 and 3
(stage 0 -> 1 adjacent, 0 -> 2 and 0 -> 3 skipping), and a boolean mask made on stage 0 gates stage 2.
The stages then run one after the other as torch's pipeline runtime runs them (each stage's inputs
are fresh leaves; backward from the last stage to the first with torch's own stage_backward, or its
split stage_backward_input / stage_backward_weight with the weight step after all input steps, the
in-place detach of the outputs in between), and the loss and every weight gradient equal one process.

Mutation checks (measured): with the pass-through output detached in pass_through._pass_on (its
gradient dropped) both gradient tests fail, layers.0's gradient off by 95% of its norm; without the
copy of surgery.own_outputs_read_inside the split-backward test fails in torch's weight step ("Trying
to use a saved tensor that has been detached in-place").
"""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_adapter.runtime.engines.pipeline import pass_through, surgery


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)] + [nn.Linear(6, 4)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        mask = x[:, :1] > 0  # bool, made on stage 0, read on stage 2: passed on without a gradient
        h0 = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h0))
        r = torch.where(mask, torch.tanh(self.layers[2](h)), h) + h0
        # stage 2 returns r and norm(r), as a GPT-2 stage ending before an MLP returns the residual
        return F.log_softmax(self.layers[3](self.norm(r)) + r[:, :4] + h0[:, :4], 1)


def _split_model():
    from torch.distributed.pipelining import SplitPoint, pipeline

    torch.manual_seed(0)
    model, x = Skip(), torch.randn(5, 6)
    reference = copy.deepcopy(model)  # the stages hold the model's own Parameter objects
    pipe = pipeline(model, (x,), split_spec={f"layers.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)})
    return reference, x, pipe


def _calls(pipe):
    return [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]


def _run_stages(pipe, x, split: bool):
    """Forward stage by stage, then backward from the last stage as torch's runtime does."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    calls = _calls(pipe)
    env, records = {next(n for n in pipe.split_gm.graph.nodes if n.op == "placeholder"): x}, []
    for i, call in enumerate(calls):
        inputs = [env[a] if i == 0 else env[a].detach().requires_grad_(env[a].is_floating_point()) for a in call.args]
        out = pipe.get_stage_module(i)(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        env[call] = out
        for user in call.users:
            env[user] = outs[user.args[1]] if user.target is operator.getitem else out
        records.append((inputs, outs))
    loss = -records[-1][1][0][:, 0].sum()
    grads, weight_steps = {}, []
    for i in reversed(range(len(calls))):
        inputs, outs = records[i]
        params = list(pipe.get_stage_module(i).parameters())
        last = i == len(calls) - 1  # its output is the loss (a tensor, as torch passes it)
        stage_out = loss if last else list(outs)
        out_grads = None if last else [grads.get((i, k)) for k in range(len(outs))]
        if split and i > 0:  # torch runs the first stage's whole backward in its weight step
            dinputs, groups = stage_backward_input([loss] if last else stage_out, out_grads, inputs, iter(params))
            weight_steps.append(lambda params=params, groups=groups: stage_backward_weight(iter(params), groups))
        else:
            dinputs = stage_backward(stage_out, out_grads, inputs)
        for arg, g in zip(calls[i].args, dinputs, strict=True):
            if g is not None and arg.op != "placeholder":
                producer = arg.args[0] if arg.target is operator.getitem else arg
                key = (calls.index(producer), arg.args[1] if arg.target is operator.getitem else 0)
                grads[key] = g if key not in grads else grads[key] + g
    for step in weight_steps:  # after every input step, as zero-bubble schedules defer them
        step()
    return loss


def test_rewrite_leaves_each_stage_reading_only_the_previous_one():
    _, _, pipe = _split_model()
    calls = _calls(pipe)
    assert pass_through.skipped_reads(calls)  # h0 and the mask skip stages before the rewrite
    threaded = pass_through.thread_skipped_values(pipe.split_gm)
    assert sorted({(i, j) for i, _, j in threaded}) == [(2, 0), (3, 0)]
    assert pass_through.skipped_reads(calls) == []
    index = {n: i for i, n in enumerate(calls)}
    for i, call in enumerate(calls):
        readers = {}  # output index -> stages reading it
        for user in call.users:
            for reader in user.users:
                readers.setdefault(user.args[1], set()).add(index.get(reader, "output"))
        if i < len(calls) - 1:  # every output read by exactly one stage, the next one
            assert set(readers) == set(range(len(readers))) and all(r == {i + 1} for r in readers.values()), readers
    # stage 1 reads h0 and passes it on (no second input for it) with the mask; stage 2 reads h, h0 and
    # the mask and passes h0 on once more, although stages 2 and 3 both read it (stage 3: norm(r), r, h0)
    assert [len(c.args) for c in calls] == [1, 2, 3, 3]
    pass_through.refuse_unthreaded(Skip(), calls)  # nothing left to refuse


@pytest.mark.parametrize("split", [False, True], ids=["stage_backward", "input_then_weight"])
def test_gradients_through_the_pass_through_equal_one_process(split):
    from smp_adapter.runtime.engines.pipeline.torch_compat import SCHEDULE_MIN_TORCH, older_than

    if split and older_than(*SCHEDULE_MIN_TORCH["zbv"]):
        pytest.skip(f"the split-backward schedules are refused on torch {torch.__version__} (torch_compat.py)")
    reference, x, pipe = _split_model()
    pass_through.thread_skipped_values(pipe.split_gm)
    if split:  # as the runtime does for the split-backward schedules (stages after the first)
        copied = [surgery.own_outputs_read_inside(pipe.get_stage_module(i)) for i in range(1, 4)]
        assert copied == [[], ["add_tensor"], []]  # r, read by norm; not h0, a stage input passed on
    loss = _run_stages(pipe, x, split)
    expected = -reference(x)[:, 0].sum()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)  # the same fp32 operations
    stage_params = dict(p for i in range(4) for p in pipe.get_stage_module(i).named_parameters())
    assert len(stage_params) == 10
    for name, p in reference.named_parameters():  # sums of the same terms in another order: 1e-6
        torch.testing.assert_close(stage_params[name].grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_non_tensor_read_past_the_next_stage_is_refused_with_the_fix():
    """torch's stages send only tensors: a value traced as a Python number is left as it is, and
    refused on every rank at the first step, with the fix."""
    from smp_adapter.errors import UnsupportedFeatureError

    _, _, pipe = _split_model()
    calls = _calls(pipe)
    i, a, j = next(read for read in pass_through.skipped_reads(calls) if read[0] == 3)  # h0, read by stage 3
    placeholders = [n for n in pipe.get_stage_module(i).graph.nodes if n.op == "placeholder"]
    placeholders[a].meta["val"] = 3  # as torch.export records a number
    assert (i, a, j) not in pass_through.thread_skipped_values(pipe.split_gm)  # stage 2's read still threaded
    message = (r"cannot run Skip cut into 4 stages: stage 3 reads the value 'getitem' made by stage 0, which is not "
               r"a tensor.*partition manually \(auto_partition: false\)")
    with pytest.raises(UnsupportedFeatureError, match=message):
        pass_through.refuse_unthreaded(Skip(), calls)
