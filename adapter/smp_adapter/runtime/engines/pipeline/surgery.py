"""Module surgery for pipeline stages: swapping modules and tensors by qualified name, and the
hooks the stage builder installs (runtime/engines/pipeline/stage_builder.py).

* ``originals_swapped_in``: the pre-TP modules back in place while torch.export traces the model;
* ``CarryInputs``: model inputs first read by a later stage, carried from stage 0;
* ``SendableOutputs``, ``contiguous_crossing_metadata``: activations cross stages contiguous (and in
  the traced dtype under autocast), into contiguous receive buffers;
* ``OwnViewOutputs``: stage outputs that are views copied, for the split backward;
* ``own_outputs_read_inside``: stage outputs the stage also reads copied, for the split backward;
* ``checkpoint_marked``: ``smp.set_activation_checkpointing`` applied again to the traced stage;
* ``run_generated_code``: the traced submodules run torch's generated code, not the fx Interpreter;
* ``no_generation_cache``: a Hugging Face model traced without its generation (KV) cache.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


class originals_swapped_in:
    """Put the pre-TP modules back while tracing (torch.export sees plain nn.Linear etc.)."""

    def __init__(self, module, originals):
        self.module, self.originals, self.saved = module, originals, {}

    def __enter__(self):
        for name, orig in self.originals.items():
            self.saved[name] = get_submodule(self.module, name)
            set_submodule(self.module, name, orig)

    def __exit__(self, *exc):
        for name, mod in self.saved.items():
            set_submodule(self.module, name, mod)


class CarryInputs:
    """Forward pre-hook used while exporting: replaces the named model inputs by copies made first
    thing in forward, so the split graph hands them from stage 0 to the stage that reads them."""

    def __init__(self, module: nn.Module, late: dict):
        self.signature = inspect.signature(module.forward)
        self.names = {n for names in late.values() for n in names}

    def __call__(self, module, args, kwargs):
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        for name in self.names:
            value = bound.arguments.get(name)
            if isinstance(value, torch.Tensor):
                bound.arguments[name] = value.clone()
        return bound.args, bound.kwargs


class SendableOutputs:
    """Forward hook of a non-last stage: its outputs cross to the next stage through point-to-point
    sends. Floating outputs go back to the traced dtype under autocast (the next stage's autocast
    narrows them again), and a non-contiguous output (GPT-J's stage 0 returns one) is made
    contiguous: gloo and NCCL send contiguous buffers only ("input tensor has to be contiguous"), and
    the receiving stage's buffer is contiguous. Values and gradients are unchanged."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        widen = autocast_state() is not None

        def sendable(t):
            if not isinstance(t, torch.Tensor):
                return t
            if widen and t.is_floating_point():
                t = t.to(self.dtype)
            return t.contiguous()

        return torch.utils._pytree.tree_map(sendable, output)


def contiguous_crossing_metadata(stage: torch.fx.GraphModule) -> list[str]:
    """torch's stage builder makes its receive buffers (a stage's inputs, and a non-last stage's output
    gradients) with the strides the trace recorded for those values. A value traced non-contiguous
    (GPT-J's stage 0 returns one) then gets a non-contiguous buffer, which gloo and NCCL refuse to
    receive into ("input tensor has to be contiguous"). The recorded values of the stage's inputs
    and outputs become contiguous ones of the same shape and dtype (the senders send contiguous
    values: SendableOutputs). Returns the names of the nodes changed."""
    output = next(n for n in stage.graph.nodes if n.op == "output")
    crossing = [n for n in stage.graph.nodes if n.op == "placeholder"]
    crossing += [a for a in torch.utils._pytree.tree_leaves(output.args) if isinstance(a, torch.fx.Node)]
    changed = []
    for node in crossing:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.is_contiguous():
            node.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
            changed.append(node.name)
    return changed


class OwnViewOutputs:
    """Forward hook of a stage whose backward is split (zero_bubble, zbv, dualpipev): an output that
    is a view (a cut right after torch.flatten / view / transpose, as the seed conv net's when cut
    into 4 stages) becomes a copy. torch's stage_backward_input detaches every stage output in place
    after the input-gradient step to free the graph, and a view cannot be ("Can't detach views
    in-place"). The copy has the same values; its gradient flows to the view unchanged."""

    def __call__(self, module, args, output):
        return torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t, output)


def merge_weight_groups(stage) -> None:
    """A stage whose backward is split: torch's input-gradient step groups the stage's parameters by
    the graph nodes (intermediates) their gradients flow through, and the weight-gradient step runs one
    autograd call per group. A weight used twice inside the stage (tied; pytorch #180952) reaches two
    intermediates, and torch's grouping (get_param_groups) merges the groups of those two only when it
    meets them in one order of a set: in the other it leaves the weight in two groups, and the weight
    step adds its gradient twice (seen: 3 of 8 microbatches at pp 2, loss off by 2e-4 at step 2) or walks
    a freed graph ("backward through the graph a second time"). Merge groups that share a parameter or
    an intermediate before the weight step: each weight then has one group, which sums both uses."""
    original = stage.backward_maybe_with_nosync

    def backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False):
        if backward_type == "weight":
            bwd_kwargs = {**bwd_kwargs, "param_groups": merged_param_groups(bwd_kwargs["param_groups"])}
        return original(backward_type, bwd_kwargs, last_backward=last_backward)

    stage.backward_maybe_with_nosync = backward_maybe_with_nosync


def merged_param_groups(groups: list[dict]) -> list[dict]:
    """torch's parameter groups (params: gradient-accumulator nodes; intermediates with the gradients
    the input step saved for them, index by index) with every two that share a parameter or an
    intermediate made one. An intermediate in both keeps one entry (both saved the same gradients)."""
    merged: list[dict] = []
    for group in groups:
        group = {"params": set(group["params"]), "intermediates": list(group["intermediates"]),
                 "grads": list(group["grads"])}
        for other in [m for m in merged if m["params"] & group["params"]
                      or set(m["intermediates"]) & set(group["intermediates"])]:
            merged.remove(other)
            group["params"] |= other["params"]
            for intermediate, grads in zip(other["intermediates"], other["grads"]):
                if intermediate not in group["intermediates"]:
                    group["intermediates"].append(intermediate)
                    group["grads"].append(grads)
        merged.append(group)
    return merged


def own_outputs_read_inside(stage: torch.fx.GraphModule) -> list[str]:
    """Under the split backward (zero_bubble, zbv, dualpipev), a stage output that the stage's own
    operations also read becomes a copy in the stage graph: GPT-2's residual stream when a stage
    ends before ln_2 (the stage returns it and layer-normalises it). torch's input-gradient step
    detaches the stage outputs in place, and the weight-gradient step that follows needs what those
    operations saved (layer norm and linear save their input for the weight gradient): "Trying to
    use a saved tensor that has been detached in-place". The copy is what gets detached; its
    gradient flows to the value unchanged. A stage input returned as it is (a value passed on,
    pass_through.py) needs no copy even when the stage reads it: it is a leaf, and detaching a
    leaf in place leaves what was saved of it usable (tests/unit/test_pipeline_pass_through.py
    runs both). Returns the names of the values copied."""
    graph = stage.graph
    out = next(n for n in graph.nodes if n.op == "output")
    single = not isinstance(out.args[0], (tuple, list))
    values = (out.args[0],) if single else tuple(out.args[0])
    copied, owned = [], []
    for value in values:
        if isinstance(value, torch.fx.Node) and value.op != "placeholder" and _read_inside(stage, value, {out}):
            with graph.inserting_before(out):
                copy = graph.call_function(torch.clone, (value,))
            copy.meta.update({k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")})
            copied.append(value.name)
            value = copy
        owned.append(value)
    if copied:
        out.args = (owned[0] if single else tuple(owned),)
        stage.recompile()
    return copied


def _read_inside(gm, value, returned_by: set) -> bool:
    """Whether ``value`` of ``gm``'s graph is read by a node other than ``returned_by``. torch.export
    keeps the module tree: a value a nested traced module returns (``transformer(...)[k]``) is
    followed into that module, and an input it returns unchanged back out to what gm gave it. The
    output of an untraced module (a tensor-parallel layer put back into the stage) is read by that
    module's own backward at most, whose saved tensors are its inputs. True when unsure."""
    import operator

    if any(user not in returned_by for user in value.users):
        return True
    if value.op == "call_function" and value.target is operator.getitem and value.args[0].op == "call_module":
        call, k = value.args
    elif value.op == "call_module":
        call, k = value, None
    else:
        return False
    graph = getattr(gm.get_submodule(call.target), "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return False
    if call.kwargs:
        return True
    sub_out = next(n for n in graph.nodes if n.op == "output")
    returned = sub_out.args[0]
    inner = returned[k] if k is not None and isinstance(returned, (tuple, list)) else returned if k is None else None
    if not isinstance(inner, torch.fx.Node):
        return True
    sub = gm.get_submodule(call.target)
    if _read_inside(sub, inner, {sub_out}):
        return True
    if inner.op == "placeholder":  # returned unchanged: does gm read what it gave the module?
        given = call.args[[n for n in graph.nodes if n.op == "placeholder"].index(inner)]
        return isinstance(given, torch.fx.Node) and _read_inside(gm, given, {call, *returned_by})
    return False


def run_generated_code(stage: nn.Module) -> list[str]:
    """torch.export's unflattened modules inside a stage (one per traced submodule: each transformer
    block, LayerNorm, Linear) run their graph through torch.fx's Interpreter, node by node, unless told
    otherwise; the Python code torch generates for the same graph runs the same operations without the
    per-node dispatch. Measured on a GPT-2-style stage (4 blocks of width 256, 229 nodes in 32 such
    modules, microbatch 4 x 32 tokens, one thread): a forward 15.9 -> 13.2 ms, i.e. ~6 % of a forward
    and backward, paid on every forward action of every schedule.

    The generated ``forward(self, ...)`` names each value after its node, and torch.export names a
    call of a submodule after it: Hugging Face BERT's attention has a submodule called ``self``
    (``BertAttention.self``), whose node would rebind ``self`` inside forward ("'Tensor' object has no
    attribute 'output'"). Such nodes are renamed and the code generated again. Returns the modules
    renamed in. Nothing edits these graphs afterwards (the stage rewrites, pass_through.py and
    own_outputs_read_inside, edit the stage's own graph and recompile it)."""
    from torch.export.unflatten import InterpreterModule

    renamed = []
    for name, module in stage.named_modules():
        if not isinstance(module, InterpreterModule) or getattr(module, "graph_module", None) is None:
            continue  # a container torch never calls (a ModuleList) has no code
        clashing = [node for node in module.graph.nodes if node.name == "self"]
        for node in clashing:
            node._rename("self_module")  # the graph's namespace makes the name unique
        if clashing:
            module.finalize()  # the code again, from the renamed graph
            renamed.append(name)
        module._run_with_interpreter = False
    return renamed


def autocast_state():
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    return None


def get_submodule(root, name):
    return root.get_submodule(name)


def has_submodule(root, name) -> bool:
    try:
        root.get_submodule(name)
        return True
    except AttributeError:
        return False


def set_submodule(root, name, new) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    setattr(owner, leaf, new)  # nn.Module.__setattr__ registers it as a submodule


def set_tensor(root, name, tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    # nn.Module.__setattr__: a Parameter is registered as one; a tensor assigned to an existing
    # buffer name replaces that buffer (its persistence is kept)
    setattr(owner, leaf, tensor)


def checkpoint_marked(module: nn.Module, stage: nn.Module) -> list[str]:
    """torch.export inlines torch.utils.checkpoint: a stage graph holds the plain ops of a module
    marked with smp.set_activation_checkpointing, and its activations would all be kept. Wrap the
    stage's traced submodule of each marked name in checkpoint again (non-reentrant, as at pp = 1).
    A group strategy's members are each wrapped: they were traced on their own (tracing_plain).
    Returns the names wrapped."""
    from smp_adapter.runtime.activation_checkpoint import checkpoint_forward

    wrapped = []
    for name, original in module.named_modules():
        if not name or not getattr(original, "_smp_checkpointed", False):
            continue  # not marked (a group's followers are traced on their own: tracing_plain)
        if has_submodule(stage, name) and get_submodule(stage, name) is not original:
            checkpoint_forward(get_submodule(stage, name), getattr(original, "_smp_preserve_rng", True), [])
            wrapped.append(name)
    return wrapped


def no_generation_cache(module: nn.Module, rank: int) -> bool:
    """A Hugging Face model whose config keeps ``use_cache=True`` (GPT-Neo's and GPT-J's do; the public
    smp templates call the model without ``use_cache=``) returns a KV-cache object from its forward,
    which torch.export cannot trace and a training step never reads. smp v1 partitioned such models;
    the cache is switched off in the config before tracing, once, with a note on rank 0. True when it
    was on."""
    config = getattr(module, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    if rank == 0:
        print(f"Pipeline parallelism: {type(module).__name__}.config.use_cache set to False (a training step "
              "reads no generation cache, and torch.export cannot trace one)", flush=True)
    return True
