"""Values that skip stages, threaded through the stages in between.

torch's splitter (``pipeline()``) hands a value from the stage that makes it straight to every stage
that reads it. GPT-2 cut into 4 stages has such values: stage 0 makes the causal mask, read by the
attention of stage 2 (and of 3 when cut finer), and a residual stream can be read two stages on.
torch's schedules with several stages per rank post sends and receives only between a stage and
the next (``schedules._add_send_recv``), and a torch stage refuses the backward of an output read by
several stages ("Backward of skip connections not supported yet", ``stage.py``), with one stage per
rank too. ``thread_skipped_values`` rewrites the split so that neither happens: every stage between
a value's maker and its reader takes the value as an extra input and returns it as an extra output.
A value read by several later stages travels the chain once (a stage that reads it passes on the
same input), so every stage output then has one reader, the next stage.

Gradients. A pass-through returns its input placeholder itself, no copy. That input is the leaf
torch made of the received buffer, so its gradient is the sum autograd forms: the gradient of the
pass-through output (sent back by the next stage) plus that of the stage's own uses. This works with
each of torch's backward steps: ``stage_backward`` (``autograd.backward`` accumulates into the leaf's
``.grad``), ``stage_backward_input`` (``autograd.grad`` of an output that is also an input returns its
output gradient, added to the other paths'; the in-place ``detach_`` afterwards un-marks the leaf,
what the stage's own operations saved of it stays usable, and the next forward of that microbatch
marks it again, ``_retrieve_recv_activations``) and
``stage_backward_weight`` (the pass-through reaches no weight). The input is not a view, so
``surgery.OwnViewOutputs`` leaves it alone. Non-float values (masks, position ids) pass through
without gradients: torch gives them none. tests/unit/test_pipeline_pass_through.py runs a split
model's backward with torch's split steps stage by stage against one process.

Only tensors are threaded: torch's stages send nothing else. ``refuse_unthreaded`` refuses what is
left (a non-tensor value read past the next stage), with the fix.
"""

from __future__ import annotations

import operator

import torch
from torch import fx


def producer_stage(node, index: dict):
    """The stage (index into the stage calls) whose output ``node`` is, or None (a model input)."""
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return index.get(node)


def skipped_reads(stage_calls: list) -> list[tuple[int, int, int]]:
    """(reader stage, argument position, maker stage) for each argument read past the next stage."""
    index = {n: i for i, n in enumerate(stage_calls)}
    return [(i, a, j) for i, node in enumerate(stage_calls) for a, arg in enumerate(node.args)
            if isinstance(arg, fx.Node) and (j := producer_stage(arg, index)) is not None and j < i - 1]


def thread_skipped_values(split_gm: fx.GraphModule) -> list[tuple[int, int, int]]:
    """Rewrite the split graph (top level and stage graphs) so that every tensor a stage reads from
    a non-adjacent earlier stage reaches it through the stages in between. Returns the reads that
    were threaded, as ``skipped_reads`` gives them."""
    stage_calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    reads = [(i, a, j) for i, a, j in skipped_reads(stage_calls)
             if isinstance(_placeholders(_module(split_gm, stage_calls[i]))[a].meta.get("val"), torch.Tensor)]
    if not reads:
        return []
    carriers = sorted({s for i, _, j in reads for s in range(j + 1, i)})
    for s in carriers:  # every carrier returns a tuple, so its outputs are read by getitem nodes
        _outputs_as_tuple(split_gm, stage_calls[s])
    carried: dict = {}  # (value node at its maker, carrier stage) -> the carrier's output node of it
    for i, a, j in reads:
        reader = stage_calls[i]
        value = source = reader.args[a]  # the maker's output node (its getitem)
        meta = _placeholders(_module(split_gm, reader))[a].meta
        for s in range(j + 1, i):
            if (value, s) not in carried:
                carried[(value, s)] = _pass_on(split_gm, stage_calls[s], source, meta)
            source = carried[(value, s)]
        reader.update_arg(a, source)
    for s in carriers:
        _module(split_gm, stage_calls[s]).recompile()
    split_gm.graph.lint()
    split_gm.recompile()
    return reads


def _module(split_gm, call) -> fx.GraphModule:
    return split_gm.get_submodule(call.target)


def _placeholders(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _output(gm):
    return next(n for n in gm.graph.nodes if n.op == "output")


def _outputs_as_tuple(split_gm, call) -> None:
    """A stage returning one value returns a one-tuple instead; its readers read element 0."""
    out = _output(_module(split_gm, call))
    if isinstance(out.args[0], (tuple, list)):
        return
    out.args = ((out.args[0],),)
    with split_gm.graph.inserting_after(call):
        first = split_gm.graph.call_function(operator.getitem, (call, 0))
    call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)


def _pass_on(split_gm, call, source, meta) -> fx.Node:
    """Stage ``call`` takes ``source`` (unless it already reads it) and returns it as a new last
    output; returns the top-level node of that output. The getitem nodes of a stage must stay in
    output order (torch numbers a stage's outputs by the order of its getitem users)."""
    gm = _module(split_gm, call)
    placeholders = _placeholders(gm)
    if source in call.args:
        held = placeholders[call.args.index(source)]
    else:
        with gm.graph.inserting_after(placeholders[-1]):
            held = gm.graph.placeholder(f"passed_{source.name}")
        held.meta.update({k: v for k, v in meta.items() if k in ("val", "tensor_meta")})
        call.args = (*call.args, source)
    out = _output(gm)
    values = tuple(out.args[0])
    out.args = ((*values, held),)  # the input itself: see the module docstring for its gradient
    last = max((u for u in call.users if u.target is operator.getitem), key=lambda u: u.args[1])
    with split_gm.graph.inserting_after(last):
        return split_gm.graph.call_function(operator.getitem, (call, len(values)))


def refuse_unthreaded(module, stage_calls: list) -> None:
    """After ``thread_skipped_values``: a stage still reading a value of a non-adjacent stage reads
    a non-tensor (a Python number traced as a value), which no torch stage can send. Refuse it on
    every rank alike, at the first step, instead of a failure inside torch."""
    reads = skipped_reads(stage_calls)
    if reads:
        from smp_adapter.errors import UnsupportedFeatureError

        i, a, j = reads[0]
        raise UnsupportedFeatureError(
            f"pipeline parallelism cannot run {type(module).__name__} cut into {len(stage_calls)} stages: stage {i} "
            f"reads the value {stage_calls[i].args[a].name!r} made by stage {j}, which is not a tensor, and pipeline "
            "stages pass only tensors between them. Compute it where it is read (or make it a tensor in forward), or "
            "partition manually (auto_partition: false) so that the module making it and the one reading it are in "
            "one stage")
