"""``smp.nn`` distributed modules: sizes in arguments are global (summed over
TP ranks); each module takes the TP group from the current ``TPContext`` at construction and raises
``NotInitializedError`` before ``smp.init``.

Batch semantics: with ``prescaled_batch=False`` every TP rank holds its own samples;
a distributed module gathers what it needs of the TP group's batch, computes its shard and returns
each rank the outputs of its own samples. With ``prescaled_batch=True`` all TP ranks hold the same
batch and only slice it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smp_adapter import on_shutdown
from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError
from smp_adapter.parallel import comm, marking
from smp_adapter.parallel.layers import ShardLayout, mark_distributed, row_parallel_forward
from smp_adapter.parallel.context import DistributedModule, TPContext, using_tp_context
from smp_adapter.parallel.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)


_skip_init = False  # True only inside from_linear (the weights are copied in, not drawn)


@on_shutdown
def reset() -> None:
    """smp.shutdown: back to drawing initial weights (in case a from_linear was interrupted)."""
    global _skip_init
    _skip_init = False


def _divisible(what: str, value: int, tp: int) -> None:
    if value % tp:
        raise SMPUsageError(f"{what}={value} is not divisible by the tensor-parallel degree {tp}")


class DistributedLinear(DistributedModule):
    """Tensor-parallel ``nn.Linear``: the weight's *input* dimension is divided by
    ``tp_size`` (local weight ``[out, in/tp]``, the bias is whole). Each TP rank takes its feature
    slice of the TP group's samples, multiplies, and a reduce-scatter (sum) returns each rank the
    output of its own samples (all-reduce when ``prescaled_batch``). Functionally ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        _divisible("in_features", in_features, self.tp_size)
        self.in_features, self.out_features = in_features, out_features
        local_in = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        mark_distributed(self.weight, ShardLayout((out_features, in_features), 1), self.tp_context)
        if not _skip_init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation of the full matrix; keep this rank's columns
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        with torch.no_grad():
            self.weight.copy_(full.chunk(self.tp_size, 1)[self.tp_rank])
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ctx: TPContext) -> "DistributedLinear":
        """Split an existing ``nn.Linear``: the weights are sliced from the original's."""
        global _skip_init
        with using_tp_context(ctx):
            _skip_init = True  # the weights are copied below: don't draw from the RNG
            try:
                new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
            finally:
                _skip_init = False
        with torch.no_grad():
            new.weight.copy_(linear.weight.chunk(ctx.size, 1)[ctx.rank])
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        new.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            new.bias.requires_grad_(linear.bias.requires_grad)
        return new

    def forward(self, x):
        return row_parallel_forward(x, self.weight, self.bias, self.tp_context, standalone=True)

    def extra_repr(self):
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.tp_size}")


class DistributedEmbedding(DistributedModule):
    """Tensor-parallel ``nn.Embedding`` split along the embedding dimension: the local
    weight is ``[num_embeddings, embedding_dim/tp]``. ``_weight`` may be the full ``[V, D]`` tensor
    (sliced) or this rank's ``[V, D/tp]`` slice. ``_skip_allgather``: the input ids already are the TP
    group's batch; ``_skip_scatter_and_merge``: return the local ``[..., D/tp]`` slice of every
    sample instead of each rank's own samples with all features."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, _weight=None, initializer_range=0.02,
                 _skip_allgather=False, _skip_scatter_and_merge=False):
        super().__init__()
        if max_norm is not None:
            raise UnsupportedFeatureError(
                "smp.nn.DistributedEmbedding(max_norm=...) is not supported: the norm spans TP ranks; "
                "use torch.nn.Embedding (left whole) or renormalise the weights yourself")
        if scale_grad_by_freq:
            raise UnsupportedFeatureError(
                "smp.nn.DistributedEmbedding(scale_grad_by_freq=True) is not supported; "
                "use torch.nn.Embedding outside tensor parallelism")
        _divisible("embedding_dim", embedding_dim, self.tp_size)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.sparse = padding_idx, sparse
        self.initializer_range = initializer_range
        self._skip_allgather, self._skip_scatter_and_merge = _skip_allgather, _skip_scatter_and_merge
        local = embedding_dim // self.tp_size
        layout = ShardLayout((num_embeddings, embedding_dim), 1)
        if _weight is None:
            full = torch.empty(num_embeddings, embedding_dim).normal_(0.0, initializer_range)
            if padding_idx is not None:
                full[padding_idx].zero_()
            w = layout.shard(full, self.tp_rank, self.tp_size)
        elif tuple(_weight.shape) == (num_embeddings, embedding_dim):
            w = layout.shard(_weight.detach(), self.tp_rank, self.tp_size)
        elif tuple(_weight.shape) == (num_embeddings, local):
            w = _weight.detach()
        else:
            raise SMPUsageError(
                f"DistributedEmbedding: _weight has shape {tuple(_weight.shape)}, expected "
                f"{(num_embeddings, embedding_dim)} (full) or {(num_embeddings, local)} (this rank's slice)")
        self.weight = nn.Parameter(w.clone())
        mark_distributed(self.weight, layout, self.tp_context)

    def forward(self, ids):
        ctx = self.tp_context
        if not ctx.prescaled_batch and not self._skip_allgather:
            ids = comm.all_gather_batch(ids, ctx.group)
        out = F.embedding(ids, self.weight, self.padding_idx, sparse=self.sparse)
        if self._skip_scatter_and_merge:
            return out
        if ctx.prescaled_batch:
            return comm.gather_last(out, ctx.group)
        return comm.batch_to_features(out, ctx.group)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim} (local {self.weight.shape[1]}), tp={self.tp_size}"


# ---------------------------------------------------------------- tp_register support


def build_registered(module: nn.Module, reg, mark_kwargs: dict):
    """Build the registered distributed replacement of ``module``: ``(new, None)``, or
    ``(None, reason)`` when it cannot be built, or ``(None, None)`` when ``init_hook`` declined."""
    recorded = marking.recorded_init_args(module)
    if recorded is None:
        return None, (f"its class was registered with smp.tp_register after the instance was created; "
                      f"register {type(module).__name__} before creating the model")
    args, kwargs = recorded
    if reg.init_hook is not None:
        res = reg.init_hook(*args, **kwargs)
        if res is None:
            return None, None
        try:
            args, kwargs = res
        except (TypeError, ValueError):
            raise SMPUsageError(
                f"init_hook for {type(module).__name__} must return an (args, kwargs) tuple or None, got {res!r}"
            ) from None
        args, kwargs = tuple(args), dict(kwargs)
    kwargs = {**kwargs, **marking.filter_init_kwargs(reg.dist_module, mark_kwargs)}
    new = reg.dist_module(*args, **kwargs)
    params = list(module.parameters())
    if params:
        new.to(params[0].device)
    if reg.forward_hook is not None or reg.return_hook is not None:
        dist_forward = new.forward
        fh, rh = reg.forward_hook, reg.return_hook

        def forward(*a, **kw):
            if fh is not None:
                a, kw = fh(*a, **kw)
            out = dist_forward(*a, **kw)
            return rh(out) if rh is not None else out

        object.__setattr__(new, "forward", forward)
    return new, None


__all__ = [
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "DistributedTransformerLMHead",
    "DistributedTransformer",
    "DistributedTransformerLayer",
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
]
