"""Autograd-aware collectives over the tensor-parallel group, written for CPU (gloo) and GPU (NCCL).

Megatron-core's own versions of the batch (first-dim) gather / reduce-scatter and of the last-dim
gather allocate their buffers with ``torch.cuda.current_device()`` (``mappings._gather_along_first_dim``,
``_reduce_scatter_along_first_dim``, ``_gather_along_last_dim``), so they are CUDA-only; the ones
here allocate with ``torch.empty_like`` on the input's device and run on gloo as well. Where
Megatron's op is device-neutral (all-reduce: ``copy_to_tensor_model_parallel_region`` /
``reduce_from_tensor_model_parallel_region``) we call Megatron's (see ``copy_to_tp`` / ``reduce_from_tp``).

Layout convention (smp semantics, prescaled_batch: docs/translation.md): tensors are batch-first. "Batch" ops move
samples between TP ranks along dim 0; rank ``r``'s own samples are block ``r`` of the gathered batch.
All ranks of a TP group must pass equally shaped tensors (smp requires equal batches per TP group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Split modules keep their TP group (Megatron's layers as ``tp_group``, ours in a TPContext), and a
# ProcessGroup cannot be pickled, so ``copy.deepcopy(model)`` (EMA copies, HF utilities) would fail.
# A process group is a handle to shared state: a deep copy refers to the same group.
if hasattr(dist, "ProcessGroup") and "__deepcopy__" not in vars(dist.ProcessGroup):
    dist.ProcessGroup.__deepcopy__ = lambda group, memo: group

# torch >= 2.13 renames the tensor collectives; keep working on the older names too.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---------------------------------------------------------------- plain (no autograd) helpers


def all_gather_batch(x: torch.Tensor, group) -> torch.Tensor:
    """[B, ...] on every rank -> [tp*B, ...] (rank order), no autograd."""
    tp = _size(group)
    if tp == 1:
        return x
    if x.dtype == torch.bool:  # not every backend reduces/gathers bool: move it as bytes
        return all_gather_batch(x.to(torch.uint8), group).bool()
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_tensor(out, x, group=group)
    return out


def reduce_scatter_batch_(x: torch.Tensor, group) -> torch.Tensor:
    """[tp*B, ...] partial sums -> [B, ...] summed over ranks, block of the caller; no autograd."""
    tp = _size(group)
    if tp == 1:
        return x
    x = x.contiguous()
    if x.shape[0] % tp:
        raise RuntimeError(f"dim 0 ({x.shape[0]}) is not divisible by the TP size {tp}")
    out = torch.empty((x.shape[0] // tp,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_tensor(out, x, group=group)
    return out


def all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """[..., F/tp] -> [..., F] (rank order along the last dim), no autograd."""
    tp = _size(group)
    if tp == 1:
        return x
    stacked = all_gather_batch(x.unsqueeze(0), group)  # [tp, ..., F/tp]
    return torch.cat(stacked.unbind(0), dim=-1)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block j of dim 0 goes to rank j; block j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _features_to_batch(x: torch.Tensor, group) -> torch.Tensor:
    # [B, ..., F] (own samples, all features) -> [tp*B, ..., F/tp] (all samples, own feature slice)
    tp = _size(group)
    chunks = torch.stack(x.chunk(tp, dim=-1), dim=0)  # [tp, B, ..., F/tp]; chunk j -> rank j
    out = _all_to_all(chunks, group)  # block j = rank j's samples, my slice
    return out.reshape((tp * x.shape[0],) + tuple(out.shape[2:]))


def _batch_to_features(x: torch.Tensor, group) -> torch.Tensor:
    # [tp*B, ..., F/tp] -> [B, ..., F]: inverse of _features_to_batch
    tp = _size(group)
    blocks = x.reshape((tp, x.shape[0] // tp) + tuple(x.shape[1:]))  # block j = rank j's samples
    out = _all_to_all(blocks, group)  # block j = my samples, rank j's feature slice
    return torch.cat(out.unbind(0), dim=-1)


# ---------------------------------------------------------------- autograd functions


def _keep_slice(x, group):
    return x.chunk(_size(group), dim=-1)[_rank(group)].contiguous()


def _differentiable(name: str, forward, backward, doc: str):
    """``f(x, group)``: ``forward(x, group)``, whose gradient is ``backward(grad, group)``; an
    autograd node only where a gradient will flow (no grad mode, or an input that needs none, calls
    ``forward`` directly), and ``x`` itself on a group of one. Each collective pair below is the other
    one's adjoint: gather / reduce-scatter, all-to-all one way / the other, gather / keep the slice."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    Function.__name__ = Function.__qualname__ = f"_{name}Function"

    def apply(x, group):
        if _size(group) == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            return Function.apply(x, group)
        return forward(x, group)

    apply.__name__, apply.__doc__ = name, doc
    return apply


gather_batch = _differentiable("gather_batch", all_gather_batch, reduce_scatter_batch_,
                               "[B, ...] -> [tp*B, ...]; gradients are summed back to the owning rank.")
reduce_scatter_batch = _differentiable("reduce_scatter_batch", reduce_scatter_batch_, all_gather_batch,
                                       "[tp*B, ...] partial sums -> [B, ...] (own samples, summed over the TP group).")
features_to_batch = _differentiable("features_to_batch", _features_to_batch, _batch_to_features,
                                    "[B, ..., F] -> [tp*B, ..., F/tp] with one all-to-all.")
batch_to_features = _differentiable("batch_to_features", _batch_to_features, _features_to_batch,
                                    "[tp*B, ..., F/tp] -> [B, ..., F] with one all-to-all.")
# Megatron's gather_from / scatter_to_tensor_model_parallel_region, which allocate on CUDA
gather_last = _differentiable("gather_last", all_gather_last, _keep_slice,
                              "All-gather along the last dim; the gradient keeps the caller's slice.")
scatter_last = _differentiable("scatter_last", _keep_slice, all_gather_last,
                               "Keep the caller's slice of the last dim; the gradient is all-gathered.")


def copy_to_tp(x, group):
    """Identity forward, all-reduce backward (Megatron's copy_to_tensor_model_parallel_region)."""
    if _size(group) == 1:
        return x
    if torch.compiler.is_exporting():
        return torch.ops.smp_adapter.copy_to_tp(x, group.group_name)
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group=group)


def reduce_from_tp(x, group):
    """All-reduce forward, identity backward (Megatron's reduce_from_tensor_model_parallel_region)."""
    if _size(group) == 1:
        return x
    if torch.compiler.is_exporting():
        return torch.ops.smp_adapter.reduce_from_tp(x, group.group_name)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


# ---------------------------------------------------------------- traced forms (torch.export)
# Pipeline stages are cut from the model by torch.export (runtime/engines/pipeline/stage_builder.py), with the Hugging
# Face units already split for tensor parallelism. A collective inside a traced unit becomes one of
# torch's functional collectives, whose gradient is the collective's own adjoint (all-gather <->
# reduce-scatter, all-to-all reversed): right for the batch exchanges above, wrong for Megatron's
# pair below, whose backward assumes that what follows is computed identically on every TP rank
# (copy_to: identity forward, all-reduce backward; reduce_from: all-reduce forward, identity
# backward). While exporting, those two are custom ops, which the stage graph keeps, backward
# included; outside export Megatron's functions run (no extra copy).


def _group_named(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def _all_reduced(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_group_named(group_name))
    return out


@torch.library.custom_op("smp_adapter::copy_to_tp", mutates_args=())
def _copy_to_tp_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.clone()  # a custom op may not return its input


@torch.library.custom_op("smp_adapter::reduce_from_tp", mutates_args=())
def _reduce_from_tp_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _all_reduced(x, group_name)


for _op in (_copy_to_tp_op, _reduce_from_tp_op):
    _op.register_fake(lambda x, group_name: torch.empty_like(x))


def _keep_group_name(ctx, inputs, output):
    ctx.group_name = inputs[1]


_copy_to_tp_op.register_autograd(lambda ctx, grad: (_all_reduced(grad, ctx.group_name), None),
                                 setup_context=_keep_group_name)
_reduce_from_tp_op.register_autograd(lambda ctx, grad: (grad, None), setup_context=_keep_group_name)
