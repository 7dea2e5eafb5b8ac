"""Parameters that several pipeline stages hold (tied weights, e.g. GPT-2's wte and lm_head): the
stages' traced copies re-pointed at the model's own tensors, one process group per set of pipeline
ranks holding a parameter (their gradients are summed over it, runtime.PipelineRunner), and the
global-norm clipping that counts such a parameter once."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from smp_adapter.runtime.engines.pipeline import surgery


def point_stages_at_model(module: nn.Module, stage_mods) -> dict:
    """Point every stage's parameters/buffers at the model's own tensors (by qualified name);
    return {id(parameter): set of stages holding it}."""
    owners: dict[int, set] = {}
    for i, sm in enumerate(stage_mods):
        for name, _ in list(sm.named_parameters(remove_duplicate=False)):
            target = module.get_parameter(name)
            surgery.set_tensor(sm, name, target)
            owners.setdefault(id(target), set()).add(i)
        for name, _ in list(sm.named_buffers(remove_duplicate=False)):
            try:
                target = module.get_buffer(name)
            except AttributeError:
                continue
            surgery.set_tensor(sm, name, target)
    return owners


def tie_groups(runner, owners: dict) -> list:
    """Parameters held by several pipeline ranks (tied weights): one group per rank set, created in
    the same order on every rank (torch requires it). Stages on one rank share the Parameter object
    itself, so autograd already sums their gradients there. ``runner``: the stage builder (its job and layout)."""
    grid, rank = runner.job.dims.grid, runner.job.rank
    by_id = {id(p): p for p in runner.model.module.parameters()}
    owners = {pid: set(runner.layout.ranks_of(stages)) for pid, stages in owners.items()}
    sets = sorted({tuple(sorted(s)) for s in owners.values() if len(s) > 1})
    mine = {}
    for stages in sets:
        for ranks in grid.groups("pp"):
            ranks = list(ranks)
            members = [ranks[s] for s in stages]
            g = dist.new_group(members) if len(members) < dist.get_world_size() else dist.group.WORLD
            if rank in members:
                mine[stages] = g
    found = [(by_id[pid], mine[tuple(sorted(s))]) for pid, s in owners.items()
             if len(s) > 1 and runner.stage_index in s and pid in by_id]
    if found and rank == 0:
        names = {id(p): n for n, p in runner.model.module.named_parameters()}
        print("Tied parameters held by several stages (gradients summed over them): "
              + ", ".join(f"{names.get(id(p), '?')}" for p, _ in found), flush=True)
    return found


def clip_grad_norm_pipeline(runner, max_norm: float, masters: dict | None = None, only: set | None = None) -> float:
    """Global-norm clipping over all stages and TP ranks (runtime/clipping.py). A parameter tied
    across stages is counted on the lowest stage holding it. ``masters`` (id(parameter) -> its fp32
    master, fp16/bf16): clip the masters' gradients instead. ``only``: the ids of the parameters to clip
    (those a script gave torch's clip_grad_norm_; every rank names the same ones). Returns the norm
    before clipping."""
    from smp_adapter.runtime.clipping import clip_by_global_norm

    model = runner.model
    holder = (lambda p: masters.get(id(p), p)) if masters else (lambda p: p)
    job = runner.job
    not_counted = {id(p) for p, grp in runner.tied if min(dist.get_process_group_ranks(grp)) != job.rank}
    grads = [(holder(p).grad, model.is_distributed_parameter(p), id(p) not in not_counted)
             for p in runner.local_params if holder(p).grad is not None and (only is None or id(p) in only)]
    return clip_by_global_norm(grads, max_norm, tp_group=job.groups.tp if job.dims.tp > 1 else None,
                               pp_group=runner.group if runner.built and runner.num_stages > 1 else None)
