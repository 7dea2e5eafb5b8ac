"""Global-norm gradient clipping (``optimizer.clip_master_grads``) where smp-adapter clips itself:
pp > 1 (no DeepSpeed engine), ZeRO-0 fp32 at pp = 1 (DeepSpeed's plain optimizer has no clip) and the
MiCS engine (gradient shards: squares summed over the sharding group).

With tensor parallelism a rank holds 1/tp of each split weight and a full copy of every replicated
parameter, so

    norm^2 = sum over split parameters (all-reduced over the TP group)
           + sum over replicated parameters (local: the same on every TP rank)

and with pp > 1 each stage's norm^2 is summed over the PP group (a parameter tied across stages is
counted on one stage only). Every rank then multiplies its gradients by the same factor
max_norm / (norm + 1e-6) when that is < 1, as torch.nn.utils.clip_grad_norm_ does. A per-rank norm
would give TP ranks different factors and let their replicated parameters drift apart.

Scripts and the Hugging Face Trainer also clip with ``torch.nn.utils.clip_grad_norm_(model.parameters(), n)``
(the Trainer through accelerate), which sees only this rank's gradients: one stage's, one TP shard.
``route_torch_clipping`` (installed by an engine whose ranks hold parts of the model) makes that call clip by
the same global norm when it is given the model's parameters.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from smp_adapter import on_shutdown


def clip_by_global_norm(grads: list[tuple[torch.Tensor, bool, bool]], max_norm: float, tp_group=None,
                        pp_group=None, shard_group=None) -> float:
    """grads: (gradient, is_split, counted) for every local gradient; ``counted`` False leaves a
    gradient out of the norm (a tied copy counted elsewhere) but still scales it. ``shard_group``: the
    gradients are shards, each group of ranks holding one copy of the whole (MiCS): their squares are
    summed over it first. Returns the norm."""
    # Each gradient's norm as torch.nn.utils.clip_grad_norm_ takes it (in its own precision, at least fp32),
    # the squares summed in fp64: a float64 copy of every gradient cost 3-7 ms per step on a 2M-element MiCS
    # shard (RESULTS §19), ten times these norms
    squares = {True: [], False: []}
    for g, is_split, counted in grads:
        if counted:
            dtype = torch.promote_types(g.dtype, torch.float32)
            squares[is_split].append(torch.linalg.vector_norm(g.detach(), 2.0, dtype=dtype).double() ** 2)
    split, replicated = (torch.stack(squares[k]).sum() if squares[k] else torch.zeros((), dtype=torch.float64)
                         for k in (True, False))
    if shard_group is not None:
        both = torch.stack([split, replicated])
        dist.all_reduce(both, group=shard_group)
        split, replicated = both[0], both[1]
    if tp_group is not None:
        dist.all_reduce(split, group=tp_group)
    total = split + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g, _, _ in grads:
            g.detach().mul_(coef)
    return norm


_route: dict = {}  # "engine": a weak reference to the engine that clips globally; "torch": torch's own function


def route_torch_clipping(engine) -> None:
    """From now until smp.shutdown(), ``torch.nn.utils.clip_grad_norm_`` given parameters of ``engine.model``
    returns ``engine.clip_grad_norm(parameters, max_norm)``: the global norm over the ranks holding the
    model's parts, every gradient scaled by the same factor (the engine's ``clip_master_grads`` rule)."""
    import torch.nn.utils.clip_grad as clip_module

    _route["engine"] = weakref.ref(engine)
    if "torch" not in _route:
        _route["torch"] = clip_module.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = _clip_grad_norm_
    # accelerate 1.16's Accelerator.clip_grad_norm_ (the Trainer's max_grad_norm) no longer calls
    # clip_grad_norm_: it takes get_total_norm of the gradients, then clip_grads_with_norm_ by that norm. The
    # norm of this model's gradients is the global one too, so that path scales every part by one factor
    if "torch_total" not in _route and hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        _route["torch_total"] = torch.nn.utils.get_total_norm
        torch.nn.utils.get_total_norm = _get_total_norm


def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    engine = _route["engine"]() if "engine" in _route else None
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if engine is not None and grads:
        owner = {id(p.grad): p for p in engine.model.parameters() if p.grad is not None}
        params = [owner[id(g)] for g in grads if id(g) in owner]
        if len(params) == len(grads):  # exactly this model's gradients (accelerate passes model.parameters()'s)
            _require_two_norm(norm_type)
            norm = torch.tensor(engine.clip_grad_norm(params, math.inf))  # the norm alone: nothing is scaled
            if error_if_nonfinite and not torch.isfinite(norm):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite "
                                   "(error_if_nonfinite=True)")
            return norm
    return _route["torch_total"](grads, norm_type, error_if_nonfinite, foreach)


def _require_two_norm(norm_type) -> None:
    if float(norm_type) != 2.0:
        from smp_adapter.errors import UnsupportedFeatureError

        raise UnsupportedFeatureError(
            f"clip_grad_norm_ with norm_type={norm_type} on a model whose parts are on several ranks: "
            "smp-adapter computes the global 2-norm only. Use norm_type=2 (the default), or "
            "optimizer.clip_master_grads(max_norm)")


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    engine = _route["engine"]() if "engine" in _route else None
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if engine is not None:
        own = {id(p) for p in engine.model.parameters()}
        if any(id(p) in own for p in params):
            _require_two_norm(norm_type)
            norm = engine.clip_grad_norm(params, float(max_norm))
            if error_if_nonfinite and not torch.isfinite(torch.tensor(norm)):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                                   "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
            return torch.tensor(norm)
    return _route["torch"](params, max_norm, norm_type, error_if_nonfinite, foreach) if "torch" in _route else \
        torch.nn.utils.clip_grad.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


@on_shutdown
def _restore_torch_clipping() -> None:
    import torch.nn.utils.clip_grad as clip_module

    original = _route.pop("torch", None)
    _route.pop("engine", None)
    if original is not None:
        torch.nn.utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = original
    total = _route.pop("torch_total", None)
    if total is not None:
        torch.nn.utils.get_total_norm = total
