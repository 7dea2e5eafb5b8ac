"""The tensor-parallel engine: split marked modules of a model in place.

Interface for the runtime (``DistributedModel``):

* ``TPContext(group, rank, size, prescaled_batch)`` and ``set_current_tp_context`` /
  ``current_tp_context``: the caller's TP group, set by the runtime after ``smp.init``;
  ``smp.nn`` modules read it at construction.
* ``apply_tensor_parallelism(module, ctx) -> list[str]``: replace the marked supported modules of
  ``module`` in place; returns the qualified names of the distributed modules.
* ``is_distributed_parameter(p)``: True for parameters split across TP ranks.
* ``tp_gradient_sync(params, ctx)``: the TP part of the gradient reduction (see its docstring).
* ``gather_full_state_dict(module, ctx)`` / ``shard_state_dict(module, full, ctx)``: unsplit
  (original key names and shapes) <-> this rank's split state dict.

Replacement rules: only the outermost *supported* module of a subtree whose own mark is enabled is
distributed (a disabled or unsupported module is descended into; its children carry their own marks).
Supported: classes registered with ``tp_register``; the transformer blocks of the Hugging Face
families in ``hf.py`` (plus their input embedding / LM head); ``nn.Linear`` -> ``DistributedLinear``
(input dimension split, as smp.nn.DistributedLinear); ``nn.Embedding`` -> vocab-parallel embedding. A module whose
sizes do not divide by the TP size, or whose parameters are shared with another module, stays whole
and a ``UserWarning`` names it and the reason. With ``size == 1`` nothing is replaced.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from smp_adapter.parallel import hf, marking
from smp_adapter.parallel.context import (  # noqa: F401  (re-exported: the runtime's interface)
    TPContext, current_tp_context, is_distributed_parameter, is_split_module, mark_distributed_parameter,
    require_tp_context, set_current_tp_context, using_tp_context)
from smp_adapter.parallel.layers import LAYOUT_ATTR, vocab_from_embedding
from smp_adapter.parallel.nn import DistributedLinear, build_registered


# ---------------------------------------------------------------- replacement


class _Walk:
    def __init__(self, root: nn.Module, ctx: TPContext, gathered):
        self.root, self.ctx, self.names, self.gathered = root, ctx, [], gathered
        self.settled: set = set()  # ids of modules already decided (left whole, with a warning)
        self.configs = hf.configs_by_module(root)  # Hugging Face units read their sizes from these
        # distinct module objects owning each parameter directly: >1 means shared weights
        self.owners: dict[int, list] = {}
        seen = set()
        for qname, m in root.named_modules(remove_duplicate=False):
            if id(m) in seen:
                continue
            seen.add(id(m))
            for p in m.parameters(recurse=False):
                self.owners.setdefault(id(p), []).append((qname, m))

    # --- helpers used by the handlers (also by hf.py)
    def shared_with(self, module: nn.Module) -> Optional[str]:
        """Name of a module outside ``module``'s subtree that owns one of its parameters, else None."""
        inside = {id(m) for m in module.modules()}
        for p in module.parameters():
            for qname, owner in self.owners.get(id(p), []):
                if id(owner) not in inside:
                    return qname or "<root>"
        return None

    def replace(self, old: nn.Module, new: nn.Module) -> None:
        """Swap ``old`` for ``new`` wherever it is registered (a module may be used twice)."""
        new.train(old.training)
        for qname, child in list(self.root.named_modules(remove_duplicate=False)):
            if child is old and qname:
                parent, _, leaf = qname.rpartition(".")
                setattr(self.root.get_submodule(parent) if parent else self.root, leaf, new)

    def warn(self, qname: str, module: nn.Module, why: str) -> None:
        """Leave ``module`` whole (it is not visited again) and say why."""
        self.settled.add(id(module))
        warnings.warn(
            f"tensor parallelism: {qname or '<root>'} ({type(module).__name__}) is not distributed "
            f"and stays whole on every rank: {why}",
            UserWarning,
            stacklevel=4,
        )

    # --- traversal
    def visit_children(self, parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            self.visit(child, prefix + name)

    def visit(self, module: nn.Module, qname: str) -> None:
        if id(module) in self.settled:
            return
        mark = marking.get_mark(module)
        if mark is not None and mark.enabled:
            outcome = self.distribute(module, qname, mark)
            if outcome == "done":
                return
        self.visit_children(module, qname + "." if qname else "")

    def distribute(self, module: nn.Module, qname: str, mark) -> str:
        """Returns "done" (handled or deliberately left whole) or "descend"."""

        if is_split_module(module):
            return "done"  # already distributed (built by the user or by a previous handler)
        # Under delayed parameter initialisation with sharded data parallel the weights are ZeRO-3
        # shards (1-D slices): a handler needs them whole to cut its TP slice, so the parameters it
        # reads are gathered for the duration of that one split (never the whole model at once).
        # The new TP modules hold plain tensors; DistributedModel partitions them afterwards.
        with self.gathered([p for m in _split_inputs(module, hf) for p in m.parameters()]):
            return self._distribute(module, qname, mark, hf)

    def _distribute(self, module: nn.Module, qname: str, mark, hf) -> str:

        reg = marking.registration_for(module)
        if reg is not None:
            return self._registered(module, qname, mark, reg)
        spec = hf.unit_spec_for(module, self.configs.get(id(module)))
        if spec is not None:
            hf.split_unit(self, module, qname, spec)
            return "descend" if spec.descend else "done"
        if hf.is_hf_model(module):
            hf.split_embeddings(self, module, qname)
            return "descend"
        if isinstance(module, nn.Linear):
            why = self._linear_problem(module)
            if why:
                self.warn(qname, module, why)
                return "done"
            if self._is_root(module, qname):
                return "done"
            # mark kwargs do not apply: the replacement copies the original's configuration and weights
            self.replace(module, DistributedLinear.from_linear(module, self.ctx))
            self.names.append(qname)
            return "done"
        if isinstance(module, nn.Embedding):
            why = self._embedding_problem(module)
            if why:
                self.warn(qname, module, why)
                return "done"
            if self._is_root(module, qname):
                return "done"

            self.replace(module, vocab_from_embedding(module, self.ctx))
            self.names.append(qname)
            return "done"
        return "descend"

    def _is_root(self, module, qname) -> bool:
        if module is self.root:
            self.warn(qname, module, "the model itself cannot be replaced in place; wrap it in a container module")
            return True
        return False

    def _linear_problem(self, m: nn.Linear) -> Optional[str]:
        tp = self.ctx.size
        if m.in_features % tp:
            return f"in_features={m.in_features} is not divisible by the tensor-parallel degree {tp}"
        other = self.shared_with(m)
        if other is not None:
            return f"it shares parameters with {other}"
        return None

    def _embedding_problem(self, m: nn.Embedding) -> Optional[str]:
        tp = self.ctx.size
        if m.num_embeddings % tp:
            return f"num_embeddings={m.num_embeddings} is not divisible by the tensor-parallel degree {tp}"
        if m.max_norm is not None or m.sparse or m.scale_grad_by_freq:
            return "max_norm, sparse and scale_grad_by_freq are not supported by the vocab-parallel embedding"
        other = self.shared_with(m)
        if other is not None:
            return f"it shares parameters with {other}"
        return None

    def _registered(self, module, qname, mark, reg) -> str:

        other = self.shared_with(module)
        if other is not None:
            self.warn(qname, module, f"it shares parameters with {other}")
            return "done"
        if self._is_root(module, qname):
            return "done"
        new, why = build_registered(module, reg, mark.kwargs)
        if new is None:
            if why:
                self.warn(qname, module, why)
            return "done"  # declined by init_hook (returned None): left whole on purpose
        self.replace(module, new)
        self.names.append(qname)
        return "done"


def _split_inputs(module: nn.Module, hf) -> list:
    """The modules whose weights a split of ``module`` reads: for a Hugging Face model (the handler
    splits its embeddings and LM head) those two, else the module itself."""
    if hf.unit_spec_for(module) is None and hf.is_hf_model(module):
        try:
            return [m for m in (module.get_input_embeddings(), module.get_output_embeddings()) if m is not None]
        except (AttributeError, NotImplementedError):
            return []
    return [module]


def _nothing_to_gather(params):
    return contextlib.nullcontext()


def apply_tensor_parallelism(module: nn.Module, ctx: TPContext, gathered=_nothing_to_gather) -> list:
    """Replace the marked supported modules of ``module`` in place; return their qualified names.
    ``gathered(params)``: a context in which parameters sharded by the data-parallel engine (ZeRO-3,
    created under delayed initialisation) hold their whole values while a split reads them (the
    engine's ``gathered`` hook; collective, every rank walks the same model in the same order)."""
    if not isinstance(ctx, TPContext):
        raise TypeError(f"expected a TPContext, got {type(ctx).__name__}")
    object.__setattr__(module, "_smp_tp_applied", True)
    if ctx.size == 1:
        return []
    walk = _Walk(module, ctx, gathered)
    with using_tp_context(ctx):
        walk.visit(module, "")
    return walk.names


# ---------------------------------------------------------------- gradients


def tp_gradient_sync(parameters: Iterable[nn.Parameter], ctx: TPContext) -> None:
    """The TP part of smp's gradient reduction, for runtimes that reduce every gradient over one
    group: call after backward, then average *all* gradients over the RDP group (e.g. DeepSpeed with
    an mpu whose data-parallel group is the RDP group).

    smp's rule: split parameters are averaged over the RDP group, the others over the DP
    group. Split parameters' gradients already average the TP group's losses (see
    ``layers.mark_distributed``). Replicated parameters: with ``prescaled_batch=True`` every TP rank
    computed the same gradient, nothing to do; without it each TP rank holds the gradient of its own
    samples, so they are averaged over the TP group here (AVG over TP, then over RDP = AVG over DP).
    """
    if ctx.size == 1 or ctx.prescaled_batch:
        return
    for p in parameters:
        if p.grad is not None and not is_distributed_parameter(p):
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=ctx.group)
            p.grad.div_(ctx.size)


# ---------------------------------------------------------------- state dicts


def gather_full_state_dict(module: nn.Module, ctx: TPContext) -> dict:
    """The unsplit state dict (original key names and shapes, e.g. Hugging Face's), on every TP rank.

    Collective over the TP group: all its ranks must call it. Tensors of replicated entries are the
    module's own (detached, like ``state_dict()``); split ones are freshly gathered.
    """
    sd = module.state_dict(keep_vars=True)
    out, done = {}, {}
    for key, t in sd.items():
        layout = getattr(t, LAYOUT_ATTR, None) if isinstance(t, torch.Tensor) else None
        if layout is None or ctx.size == 1 or t.is_meta:  # meta: another pipeline stage's (it gathers its own)
            out[key] = t.detach() if isinstance(t, torch.Tensor) else t
            continue
        if id(t) not in done:  # tied parameters are gathered once
            local = t.detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(ctx.size)]
            dist.all_gather(parts, local, group=ctx.group)
            done[id(t)] = layout.unshard(parts)
        out[key] = done[id(t)]
    return out


def shard_state_dict(module: nn.Module, full_state_dict: dict, ctx: TPContext) -> dict:
    """This rank's slice of an unsplit state dict, ready for ``module.load_state_dict``.

    Keys of ``full_state_dict`` that the module does not have pass through unchanged (so a strict
    load reports them); local, no communication.
    """
    own = module.state_dict(keep_vars=True)
    out = dict(full_state_dict)
    for key, t in own.items():
        layout = getattr(t, LAYOUT_ATTR, None) if isinstance(t, torch.Tensor) else None
        if layout is not None and key in full_state_dict and ctx.size > 1:
            out[key] = layout.shard(full_state_dict[key], ctx.rank, ctx.size)
    return out
