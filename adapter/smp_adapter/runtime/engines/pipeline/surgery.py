"""Module surgery for pipeline stages: swapping modules and tensors by qualified name, and the
hooks the stage builder installs (runtime/engines/pipeline/runtime.py).

* ``originals_swapped_in``: the pre-TP modules back in place while torch.export traces the model;
* ``CarryInputs``: model inputs first read by a later stage, carried from stage 0;
* ``WidenAutocastOutputs``: autocast activations cross stages in the traced dtype;
* ``OwnViewOutputs``: stage outputs that are views copied, for the split backward;
* ``checkpoint_marked``: ``smp.set_activation_checkpointing`` applied again to the traced stage.
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


class WidenAutocastOutputs:
    """Forward hook of a non-last stage: floating outputs back to the traced dtype under autocast."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        if autocast_state() is None:
            return None
        return torch.utils._pytree.tree_map(
            lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)


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
