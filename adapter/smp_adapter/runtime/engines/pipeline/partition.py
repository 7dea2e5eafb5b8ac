"""Choosing pipeline stages, module-granular as smp v1's auto-partition (docs/pipeline.md), as split points for torch.export.

The model is profiled once (first step, microbatch 0, no grad): forward pre-hooks record the order
in which modules are first called, forward hooks the size of their outputs. A *unit* is a module
that may start a stage. Split points are ``{qualified name: SplitPoint.BEGINNING}`` for the first
unit of stages 1..pp-1; ``torch.distributed.pipelining.pipeline`` cuts the exported graph there.

* auto (``auto_partition: true``): the module tree is expanded from the root until every unit holds
  at most 1/(4 pp) of the parameter bytes (or has no children with parameters); units are weighted
  ``memory_weight x bytes share + (1 - memory_weight) x output-size share`` and cut into pp
  contiguous runs by DeepSpeed's ``partition_balanced`` (its PipelineModule partitioner).
  Parameters shared by several modules count once, at their first user.
* manual: a module's stage is its own ``smp.partition`` / ``set_partition`` mark, else its nearest
  marked ancestor's, else ``default_partition``. Modules owning parameters, in call order, must have
  non-decreasing stages (a pipeline runs 0 -> pp-1); every stage must get at least one. A module on
  ``default_partition`` only because nothing marked it, running after a later stage's modules,
  joins the stage running at that point (logged); a *marked* module out of order is an error.
Parameter-free modules (activations, dropout) run on the stage of whatever is around them (v1.13).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.partition import partition_mark

log = logging.getLogger("smp_adapter.runtime.engines.pipeline")


@dataclass
class Profile:
    order: list  # qualified names of modules, in first-call order
    out_numel: dict  # qualified name -> numel of the first call's tensor outputs


def profile(module: nn.Module, args, kwargs) -> Profile:
    names = {m: n for n, m in module.named_modules()}
    order, out_numel, handles = [], {}, []

    def pre(m, _inp):
        name = names.get(m)
        if name is not None and name not in out_numel:
            order.append(name)
            out_numel[name] = 0

    def post(m, _inp, out):
        name = names.get(m)
        if name is not None and out_numel.get(name) == 0:
            leaves = torch.utils._pytree.tree_leaves(out)
            out_numel[name] = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))

    for m in names:
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return Profile(order, out_numel)


def _own_params(m: nn.Module):
    return list(m.parameters(recurse=False))


def _bytes(params, seen: set) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _subtree_bytes(m: nn.Module) -> int:
    return _bytes(m.parameters(), set())


def auto_units(module: nn.Module, prof: Profile, pp: int) -> list[str]:
    """Qualified names of the units, in call order."""
    rank = {n: i for i, n in enumerate(prof.order)}
    limit = _subtree_bytes(module) / (4 * pp)
    units: list[str] = []

    def first_call(m: nn.Module, name: str):
        """When a module (or, for containers such as nn.ModuleList that are never called, its first
        called descendant) first runs; None if it never runs."""
        if name in rank:
            return rank[name]
        calls = [rank[f"{name}.{n}" if name else n] for n, _ in m.named_modules()
                 if n and (f"{name}.{n}" if name else n) in rank]
        return min(calls) if calls else None

    def expand(m: nn.Module, name: str) -> None:
        kids = [(f"{name}.{n}" if name else n, c) for n, c in m.named_children()]
        kids = [(n, c, first_call(c, n)) for n, c in kids if _subtree_bytes(c) > 0]
        kids = [k for k in kids if k[2] is not None]
        if name and name in rank and (_subtree_bytes(m) <= limit or not kids or _own_params(m)):
            units.append(name)
            return
        if not name and _own_params(m) and not kids:
            return
        for n, c, _ in sorted(kids, key=lambda k: k[2]):
            expand(c, n)

    expand(module, "")
    return sorted(units, key=lambda n: rank[n])


def auto_split(module: nn.Module, prof: Profile, pp: int, memory_weight: float) -> list[list[str]]:
    """Units of each stage, balanced with DeepSpeed's linear-partition solver."""
    from smp_adapter.runtime.engines.deepspeed.parts import partition_balanced

    units = auto_units(module, prof, pp)
    if len(units) < pp:
        raise SMPUsageError(
            f"auto-partitioning found only {len(units)} module(s) with parameters to spread over {pp} pipeline "
            f"stages (pipeline_parallel_degree x virtual_pipeline_degree) ({units}): use a smaller "
            "pipeline_parallel_degree (or virtual_pipeline_degree, or pipeline: interleaved), or split the model into "
            "more submodules")
    seen: set = set()
    mods = dict(module.named_modules())
    nbytes = [_bytes(mods[u].parameters(), seen) for u in units]
    acts = [prof.out_numel.get(u, 0) for u in units]
    tb, ta = max(sum(nbytes), 1), max(sum(acts), 1)
    weights = [memory_weight * b / tb + (1 - memory_weight) * a / ta for b, a in zip(nbytes, acts)]
    # integer weights keep the solver exact and identical on every rank
    parts = partition_balanced([int(round(w * 1e6)) for w in weights], pp)
    stages = [units[parts[i]:parts[i + 1]] for i in range(pp)]
    if any(not s for s in stages):
        raise SMPUsageError(f"auto-partitioning left a pipeline stage empty ({stages}): use a smaller "
                            "pipeline_parallel_degree (or virtual_pipeline_degree), or partition manually "
                            "(auto_partition: false + smp.partition)")
    return stages


def manual_split(module: nn.Module, prof: Profile, pp: int, default: int) -> list[list[str]]:
    """Units (parameter-owning modules) of each stage, from smp.partition / set_partition marks."""
    stage_of: dict[str, tuple[int, bool]] = {}  # name -> (stage, placed by a mark rather than by default)
    for name, m in module.named_modules():
        mark = partition_mark(m)
        if mark is not None:
            stage_of[name] = (mark, True)
        else:
            parent = name.rpartition(".")[0] if name else None
            stage_of[name] = stage_of.get(parent, (default, False)) if parent is not None else (default, False)
    mods = dict(module.named_modules())
    owners = [n for n in prof.order if n and _own_params(mods[n])]
    if not owners:
        raise SMPUsageError("the model has no modules with parameters to place on pipeline stages")
    stages: list[list[str]] = [[] for _ in range(pp)]
    current, last_name, moved = 0, None, []
    for n in owners:
        s, marked = stage_of[n]
        if s < current and not marked:
            # Left on default_partition but run after a later stage's modules (a final LayerNorm or
            # LM head after layers placed with set_partition, as the AWS GPT scripts do). smp v1's
            # executor could send activations back to an earlier stage; sequential stages cannot,
            # so the module joins the stage running at that point (logged below).
            moved.append(f"{n} -> {current}")
            s = current
        if s < current:
            raise SMPUsageError(
                f"manual partition: module '{n}' is placed on stage {s} but runs after '{last_name}' on stage {current}; "
                "stages must run in order 0..pp-1. Create it inside the smp.partition() of the stage it runs in, or "
                f"call smp.set_partition(model.{n}, {current}) before the first step")
        current, last_name = s, n
        stages[s].append(n)
    if moved:
        log.warning("manual partition: modules left on default_partition=%d run after later stages and were placed "
                    "on the stage running at that point: %s", default, ", ".join(moved))
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        raise SMPUsageError(
            f"manual partition: no module with parameters is placed on stage(s) {empty} of {pp}: create modules "
            "inside `with smp.partition(i):` for every stage, use smp.set_partition(module, i), or set "
            "auto_partition: true")
    return stages


def split_spec(stages: list[list[str]]) -> dict:
    from torch.distributed.pipelining import SplitPoint

    return {s[0]: SplitPoint.BEGINNING for s in stages[1:]}


def unit_path(name: str) -> str:
    """A unit as the script reaches it: its path from the model given to smp.DistributedModel
    (``model.transformer.h.3``; an nn.Sequential's layers are ``model.0``, ``model.2``, which printed bare
    read as stage numbers)."""
    return f"model.{name}" if name else "model"


def assignment_text(stages: list[list[str]], how: str, layout=None) -> str:
    """What rank 0 prints once the stages are chosen (smp's log): "Partition assignments (...):" then
    "model.<path> -> stage" per unit; with several stages per rank, "model.<path> -> stage (rank r)"."""
    per_rank = f", {layout.v} per rank" if layout is not None and layout.v > 1 else ""
    lines = [f"Partition assignments ({how}, {len(stages)} stages{per_rank}; model is the module given to "
             "smp.DistributedModel):"]
    for i, units in enumerate(stages):
        for u in units:
            lines.append(f"  {unit_path(u)} -> {layout.describe(i) if layout is not None else i}")
    return "\n".join(lines)


def log_assignment(stages: list[list[str]], how: str, layout=None) -> None:
    text = assignment_text(stages, how, layout)
    log.info(text)
    print(text, flush=True)
