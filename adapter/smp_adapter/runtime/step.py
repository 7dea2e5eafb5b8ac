"""``@smp.step`` and ``StepOutput`` (docs/runtime.md, training-loop semantics).

A step call splits every tensor argument on its batch axis into ``microbatches`` pieces and runs
the body once per microbatch; ``model.backward`` accumulates gradients (averaged over microbatches
unless ``average_grads_across_microbatches=False``). Batch arithmetic per call:
    per-rank batch B -> microbatches m of B / m samples each; B % m must be 0.
Return value: the body's structure with every tensor replaced by a StepOutput of m tensors;
other values (Python scalars, strings) become a list with one entry per microbatch (our choice).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from smp_adapter.config.dims import per_microbatch
from smp_adapter.errors import SMPUsageError
from smp_adapter.ledger import record as comm_ledger
from smp_adapter.runtime.state import require_initialized, state


class StepOutput:
    """One output of a step function, one tensor per microbatch (``outputs[mb]``)."""

    def __init__(self, outputs):
        self.outputs = list(outputs)

    def reduce_mean(self):
        return sum(self.outputs[1:], self.outputs[0]) / len(self.outputs)

    def reduce_sum(self):
        return sum(self.outputs[1:], self.outputs[0])

    def concat(self):
        import torch

        return torch.cat(self.outputs, dim=0)

    def stack(self):
        import torch

        return torch.stack(self.outputs)

    def __len__(self):
        return len(self.outputs)

    def __iter__(self):
        return iter(self.outputs)

    def __getitem__(self, index):
        return self.outputs[index]

    def __repr__(self):
        return f"StepOutput({self.outputs!r})"

    def __getattr__(self, name: str):
        # Tensor methods are forwarded to every microbatch: loss_mb.detach(), out.cpu(), ...
        import torch

        if name.startswith("_") or not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"StepOutput has no attribute {name!r} (it holds one tensor per microbatch in .outputs)")

        def forwarded(*args, **kwargs):
            results = [getattr(t, name)(*args, **kwargs) for t in self.outputs]
            return StepOutput(results) if all(isinstance(r, torch.Tensor) for r in results) else results

        return forwarded


def step(non_split_inputs=None, input_split_axes=None, detach_outputs: bool = True):
    """Decorator, bare (``@smp.step``) or called: ``@smp.step()``, ``@smp.step(["mask"])`` / ``@smp.step(
    non_split_inputs, input_split_axes)`` (the positional form smp v1's documentation gives) or with keywords.
    ``non_split_inputs``: argument names passed whole to every microbatch; ``input_split_axes``: argument
    name -> the axis it is split along (0 otherwise)."""
    if callable(non_split_inputs) and input_split_axes is None:  # bare @smp.step: the decorated function itself
        return _step(non_split_inputs, set(), {}, detach_outputs)
    names, axes = _split_spec(non_split_inputs, input_split_axes)
    return functools.partial(_step, non_split=names, axes=axes, detach_outputs=detach_outputs)


def _split_spec(non_split_inputs, input_split_axes) -> tuple[set, dict]:
    if non_split_inputs is None:
        names = set()
    elif isinstance(non_split_inputs, str) or not isinstance(non_split_inputs, (list, tuple, set, frozenset)) \
            or not all(isinstance(n, str) for n in non_split_inputs):
        raise SMPUsageError(f"smp.step: non_split_inputs must be a list of argument names (str), got "
                            f"{non_split_inputs!r}: write e.g. @smp.step(non_split_inputs=['mask'])")
    else:
        names = set(non_split_inputs)
    if input_split_axes is None:
        axes = {}
    elif not isinstance(input_split_axes, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in input_split_axes.items()):
        raise SMPUsageError(f"smp.step: input_split_axes must map argument names (str) to batch axes (int), got "
                            f"{input_split_axes!r}: write e.g. @smp.step(input_split_axes={{'x': 1}})")
    else:
        axes = dict(input_split_axes)
    return names, axes


def _step(func, non_split: set, axes: dict, detach_outputs: bool):
    if not callable(func):
        raise SMPUsageError("smp.step decorates a function: write @smp.step or @smp.step(...) above `def train_step(...)`")
    params = inspect.signature(func).parameters
    for name in list(non_split) + list(axes):
        if name not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise SMPUsageError(f"smp.step: '{name}' in non_split_inputs/input_split_axes is not an argument of "
                                f"{func.__name__}{inspect.signature(func)}: use the argument's name")

    @functools.wraps(func)
    def run_step(*args, **kwargs):
        s = require_initialized("step")
        if s.progress.in_step:
            raise SMPUsageError("smp.step functions cannot be nested: call the step function from the training loop")
        bound = inspect.signature(func).bind(*args, **kwargs)
        m = s.cfg.microbatches
        split = {name: _split(value, m, axes.get(name, 0), name) if name not in non_split else [value] * m
                 for name, value in bound.arguments.items()}
        bound_mbs = [inspect.BoundArguments(bound.signature, {n: v[mb] for n, v in split.items()}) for mb in range(m)]
        comm_ledger.note_step_call(s.model)
        s.progress.in_step = True
        try:
            if s.model is None:  # a step function without a model: the body runs once per microbatch
                results = run_microbatches(func, bound_mbs)
            else:  # the engine runs the microbatches (DeepSpeed: in order; pipeline: a schedule)
                results = s.model.runtime_engine.run_step(func, bound_mbs, detach_outputs)
                comm_ledger.note_step_timing(s.model.runtime_engine.step_timing())
        finally:
            s.progress.in_step, s.progress.microbatch = False, None
        s.progress.step_calls += 1
        return _merge(results, detach_outputs)

    return run_step


def run_microbatches(func, bound_mbs: list, before_each=None) -> list:
    """Run the body once per microbatch, in order; ``before_each(mb, m)`` first if given."""
    results = []
    for mb, bound in enumerate(bound_mbs):
        state.progress.microbatch = mb
        if before_each is not None:
            before_each(mb, len(bound_mbs))
        results.append(func(*bound.args, **bound.kwargs))
    return results


def _split(value: Any, m: int, axis: int, name: str) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * m
        n = value.shape[axis]
        size = per_microbatch(n, m)
        if size is None:
            raise SMPUsageError(
                f"smp.step: argument '{name}' has {n} samples on axis {axis}, which does not divide into "
                f"microbatches={m}: use a batch size that is a multiple of {m} (DataLoader(..., drop_last=True)), "
                f"or pass it whole with @smp.step(non_split_inputs=['{name}'])")
        return list(torch.split(value, size, dim=axis))
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(m, mb, axis) for mb in range(m)]
    if isinstance(value, (list, tuple)) and not _is_namedtuple(value):
        parts = [_split(v, m, axis, name) for v in value]
        return [type(value)(p[mb] for p in parts) for mb in range(m)]
    if isinstance(value, dict):
        parts = {k: _split(v, m, axis, f"{name}[{k!r}]") for k, v in value.items()}
        return [type(value)((k, p[mb]) for k, p in parts.items()) for mb in range(m)]
    if isinstance(value, Mapping):  # not a dict: transformers' BatchEncoding (a UserDict), what its collators return
        parts = {k: _split(v, m, axis, f"{name}[{k!r}]") for k, v in value.items()}
        return [_same_mapping_type(value, {k: p[mb] for k, p in parts.items()}) for mb in range(m)]
    return [value] * m  # models, ints, strings: passed through unchanged


def _same_mapping_type(original: Mapping, items: dict) -> Mapping:
    """``items`` in the type of ``original`` where that type is built from a dict (UserDict, BatchEncoding),
    else a dict: the step body reads a microbatch's mapping as it read the batch's."""
    try:
        return type(original)(items)
    except TypeError:
        return items


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _merge(results: list, detach: bool):
    import torch

    first = results[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([r.detach() if detach else r for r in results])
    if isinstance(first, (list, tuple)) and not _is_namedtuple(first):
        merged = [_merge([r[i] for r in results], detach) for i in range(len(first))]
        return type(first)(merged)
    if isinstance(first, dict):
        return type(first)((k, _merge([r[k] for r in results], detach)) for k in first)
    if first is None:
        return None
    if hasattr(first, "to_tuple") and hasattr(first, "keys"):  # Hugging Face ModelOutput
        return {k: _merge([r[k] for r in results], detach) for k in first.keys()}
    return list(results)
