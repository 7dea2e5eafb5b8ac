"""Tensor-parallel shard layers: Megatron-core's ColumnParallelLinear / RowParallelLinear /
VocabParallelEmbedding with smp's batch semantics.

What comes from Megatron-core 0.16 (all three take an explicit ``tp_group``, so
``parallel_state.initialize_model_parallel`` is not needed): the classes, their partitioning
(contiguous chunks: column = rows ``[r*out/tp, (r+1)*out/tp)`` of the ``[out, in]`` weight, row =
columns ``[r*in/tp, ...)``, vocab = rows ``[r*V/tp, ...)``), their parameter creation with
``use_cpu_initialization=True`` and the local matmul autograd function
(``linear_with_grad_accumulation_and_async_allreduce``, with its GPU gradient-accumulation fusion).
Weights are not initialised by Megatron (``perform_initialization=False``): they are copied from
slices of the original module (``from_dense``), so a model built identically on every rank gives
the unsplit model's outputs once split.

What we replace: the communication around the matmul. Megatron's forward either all-reduces
(replicated batch = smp ``prescaled_batch=True``) or, for batch-exchanging layouts, goes through the
sequence-parallel gathers/reduce-scatters that allocate on ``torch.cuda.current_device()``. smp's
default (``prescaled_batch=False``) is exactly that exchange along the batch dim, so the
``forward`` methods below call ``comm`` ops that run on gloo too.

Region convention: a column layer computes only its local matmul; the module that feeds a group
of column layers (an attention block, an MLP) "enters" the TP region once (``enter_region``:
batch all-gather for prescaled False, Megatron's ``copy_to`` for True). A row layer leaves the
region: reduce-scatter to the owning rank (prescaled False) or all-reduce (True), then adds its
bias once. A column layer used alone (LM head) does both itself (``standalone=True``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from smp_adapter.parallel import comm
from smp_adapter.translate.megatron import tp_layer_settings

DISTRIBUTED_ATTR = "_smp_tp_distributed"
LAYOUT_ATTR = "_smp_tp_layout"


def _megatron():
    """Import Megatron-core's TP layers lazily (it warns about missing TE/Apex on import)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import layers
    return ModelParallelConfig, layers


def megatron_config(size: int, dtype: torch.dtype):
    ModelParallelConfig, _ = _megatron()
    return ModelParallelConfig(
        **tp_layer_settings(size),
        use_cpu_initialization=True,  # CPU parameter allocation; we copy weights in afterwards
        perform_initialization=False,
        params_dtype=dtype,
    )


def _no_init(_tensor):  # Megatron requires an init_method; weights are copied in by from_dense
    return None


# ---------------------------------------------------------------- shard layout bookkeeping


@dataclass(frozen=True)
class ShardLayout:
    """How a local parameter relates to the full (unsplit, original-layout) tensor.

    ``full`` (original orientation) is cut into ``parts`` equal segments along ``dim`` (fused
    projections, e.g. GPT-2's q|k|v); rank ``r`` keeps chunk ``r`` of every segment, concatenated.
    The stored local parameter is the transpose of that when ``transposed`` (GPT-2's ``Conv1D``
    keeps ``[in, out]``, Megatron's layers ``[out, in]``). ``shard`` returns, and ``unshard`` takes,
    tensors in the stored orientation.
    """

    full_shape: tuple
    dim: int
    parts: int = 1
    transposed: bool = False

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(f"expected a tensor of shape {tuple(self.full_shape)}, got {tuple(full.shape)}")
        segs = [seg.chunk(size, self.dim)[rank] for seg in full.chunk(self.parts, self.dim)]
        local = torch.cat(segs, self.dim)
        return local.t() if self.transposed else local

    def unshard(self, locals_: list) -> torch.Tensor:
        pieces = [(t.t() if self.transposed else t).chunk(self.parts, self.dim) for t in locals_]
        return torch.cat([torch.cat([p[i] for p in pieces], self.dim) for i in range(self.parts)], self.dim)


def _scale_grad(grad: torch.Tensor, factor: float) -> torch.Tensor:
    return grad * factor


def mark_distributed(param: nn.Parameter, layout: Optional[ShardLayout], ctx) -> None:
    """Tag a parameter split across TP ranks (and tell Megatron/DeepSpeed it is model-parallel).

    Gradient scale: without ``prescaled_batch`` a split parameter computes on the TP group's gathered
    batch, so backward sums the contributions of all ``tp`` ranks' losses. A gradient hook divides by
    ``tp``: the split parameter's gradient is then the average over the TP group's losses, the same
    average that data parallelism applies to replicated parameters. Hence smp's rule holds as is:
    average split parameters over the RDP group, the others over the DP group.
    """
    setattr(param, DISTRIBUTED_ATTR, True)
    if layout is not None:
        setattr(param, LAYOUT_ATTR, layout)
        _, layers = _megatron()
        # tensor_model_parallel/partition_dim/stride (Megatron's meaning: dim of the *stored* tensor; stride
        # = fused segments) let DeepSpeed's and Megatron's grad-norm and checkpoint code treat it as split
        dim = param.dim() - 1 - layout.dim if layout.transposed else layout.dim
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        layers.set_tensor_model_parallel_attributes(param, True, dim, layout.parts)
    if ctx.size > 1 and not ctx.prescaled_batch and not getattr(param, "_smp_tp_grad_scaled", False):
        param.register_hook(functools.partial(_scale_grad, factor=1.0 / ctx.size))
        param._smp_tp_grad_scaled = True


def _copy_(param: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))


def enter_region(x: torch.Tensor, ctx) -> torch.Tensor:
    """Replicated input of a group of column layers -> their common TP-region input."""
    if ctx.prescaled_batch:
        return comm.copy_to_tp(x, ctx.group)
    return comm.gather_batch(x, ctx.group)


def local_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``x @ weight.T`` through Megatron's linear autograd functions, with no communication."""
    _, layers = _megatron()
    if not weight.requires_grad:
        return layers.linear_with_frozen_weight(x, weight, None, False, False, False, group)
    settings = tp_layer_settings(1)
    return layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=settings["gradient_accumulation_fusion"], allreduce_dgrad=False,
        sequence_parallel=settings["sequence_parallel"], tp_group=group,
    )


def row_parallel_forward(x, weight, bias, ctx, standalone: bool):
    """Row-parallel linear with smp semantics (``weight`` = local ``[out, in/tp]``).

    ``standalone`` (a lone linear): ``x`` is the rank's full-feature input ``[B, ..., in]``; it is
    first cut to the rank's feature slice - of the TP group's whole batch (``[tp*B, ..., in/tp]``,
    one all-to-all) when each rank holds its own batch, of the shared batch when prescaled.
    Otherwise ``x`` is already the TP-region tensor. The partial sums then leave the region:
    reduce-scatter along the batch to the owning rank (Megatron's equivalent is the CUDA-only
    sequence-parallel path), or all-reduce when prescaled (Megatron's reduce_from). Bias added once.
    """
    if standalone:
        x = comm.scatter_last(x, ctx.group) if ctx.prescaled_batch else comm.features_to_batch(x, ctx.group)
    partial = local_linear(x, weight, ctx.group)
    if ctx.prescaled_batch:
        out = comm.reduce_from_tp(partial.contiguous(), ctx.group)
    else:
        out = comm.reduce_scatter_batch(partial, ctx.group)
    return out + bias if bias is not None else out


def _state_dict_like_torch(cls):
    # Megatron adds an "_extra_state" entry (None) to every state_dict; keep the original keys so a
    # split model's state_dict has exactly the unsplit model's key names.
    cls.get_extra_state = nn.Module.get_extra_state
    cls.set_extra_state = nn.Module.set_extra_state
    cls.__qualname__ = cls.__name__  # built inside a function (lazy Megatron import)
    return cls


class ShardMixin:
    """Base of the Megatron-core layers built here (they carry their TPContext, ``tp``)."""

    def _drop_megatron_hooks(self):
        self._load_state_dict_pre_hooks.clear()  # the "_extra_state" setdefault hook

    @property
    def tp(self):
        return self._smp_tp_ctx


def _build_column_cls():
    _, layers = _megatron()

    @_state_dict_like_torch
    class ColumnShardLinear(ShardMixin, layers.ColumnParallelLinear):
        """Output features split across TP ranks. Local matmul only, unless ``standalone``."""

        def __init__(self, in_features, out_features, ctx, bias=True, dtype=torch.float32, standalone=False):
            super().__init__(
                in_features, out_features, config=megatron_config(ctx.size, dtype), init_method=_no_init,
                bias=bias, gather_output=False, disable_grad_reduce=True, tp_group=ctx.group,
            )
            self._drop_megatron_hooks()
            self._smp_tp_ctx = ctx
            self.in_features, self.out_features = in_features, out_features
            self.standalone = standalone

        def forward(self, x):
            ctx = self._smp_tp_ctx
            if self.standalone:
                x = enter_region(x, ctx)
            out, _ = super().forward(x)
            if self.standalone:  # every rank gets all output features of its own samples
                out = comm.gather_last(out, ctx.group) if ctx.prescaled_batch else comm.batch_to_features(out, ctx.group)
            return out

        def extra_repr(self):
            return f"in_features={self.in_features}, out_features={self.out_features} (local {self.output_size_per_partition}), tp={self._smp_tp_ctx.size}, standalone={self.standalone}"

    return ColumnShardLinear


def _build_row_cls():
    _, layers = _megatron()

    @_state_dict_like_torch
    class RowShardLinear(ShardMixin, layers.RowParallelLinear):
        """Input features split across TP ranks; the partial sums leave the TP region here.
        ``standalone``: the input is the replicated/own-sample full-feature tensor (a lone linear)."""

        def __init__(self, in_features, out_features, ctx, bias=True, dtype=torch.float32, standalone=False):
            super().__init__(
                in_features, out_features, config=megatron_config(ctx.size, dtype), init_method=_no_init,
                bias=bias, input_is_parallel=True, skip_bias_add=True, tp_group=ctx.group,
            )
            self._drop_megatron_hooks()
            self._smp_tp_ctx = ctx
            self.in_features, self.out_features = in_features, out_features
            self.standalone = standalone

        def forward(self, x):
            return row_parallel_forward(x, self.weight, self.bias, self._smp_tp_ctx, self.standalone)

        def extra_repr(self):
            return f"in_features={self.in_features} (local {self.input_size_per_partition}), out_features={self.out_features}, tp={self._smp_tp_ctx.size}, standalone={self.standalone}"

    return RowShardLinear


def _build_vocab_cls():
    _, layers = _megatron()

    @_state_dict_like_torch
    class VocabShardEmbedding(ShardMixin, layers.VocabParallelEmbedding):
        """Vocabulary split across TP ranks. The lookup of Megatron's forward, with ``padding_idx``
        honoured (no gradient for the padding row, as nn.Embedding) and smp's batch exchange."""

        def __init__(self, num_embeddings, embedding_dim, ctx, padding_idx=None, dtype=torch.float32):
            super().__init__(
                num_embeddings, embedding_dim, init_method=_no_init,
                config=megatron_config(ctx.size, dtype), tp_group=ctx.group,
            )
            self._smp_tp_ctx = ctx
            self.padding_idx = padding_idx

        def forward(self, ids):
            ctx = self._smp_tp_ctx
            if not ctx.prescaled_batch:
                ids = comm.all_gather_batch(ids, ctx.group)  # integer ids: no autograd
            start, end = self.vocab_start_index, self.vocab_end_index
            outside = (ids < start) | (ids >= end)
            local = (ids - start).masked_fill(outside, 0)
            pad = self.padding_idx
            pad = pad - start if pad is not None and start <= pad < end else None
            out = F.embedding(local, self.weight, padding_idx=pad)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            if ctx.prescaled_batch:
                return comm.reduce_from_tp(out.contiguous(), ctx.group)
            return comm.reduce_scatter_batch(out, ctx.group)

        def extra_repr(self):
            return f"{self.num_embeddings}, {self.embedding_dim}, vocab [{self.vocab_start_index}, {self.vocab_end_index}), tp={self._smp_tp_ctx.size}"

    return VocabShardEmbedding


_classes: dict = {}


def _cls(name):
    if name not in _classes:
        _classes["column"] = _build_column_cls()
        _classes["row"] = _build_row_cls()
        _classes["vocab"] = _build_vocab_cls()
    return _classes[name]


def shard_classes():
    """(ColumnShardLinear, RowShardLinear, VocabShardEmbedding) — built on first use (lazy Megatron import)."""
    return _cls("column"), _cls("row"), _cls("vocab")


# ---------------------------------------------------------------- construction from dense modules


def dense_weight(module: nn.Module):
    """``(weight [out, in] view, bias, transposed)`` of an nn.Linear or a transformers Conv1D."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return module.weight.t(), module.bias, True
    raise TypeError(f"{type(module).__name__} is not a dense layer")


def dense_sizes(module: nn.Module):
    w, _, _ = dense_weight(module)
    return w.shape[1], w.shape[0]  # in, out


def _check_partition(new: nn.Module, expected: tuple, ctx) -> None:
    if tuple(new.weight.shape) != expected:
        raise RuntimeError(
            f"TPContext says tp_size={ctx.size} but the process group has "
            f"{None if ctx.group is None else ctx.group.size()} ranks: local weight {tuple(new.weight.shape)}, "
            f"expected {expected}"
        )


def column_from_dense(module: nn.Module, ctx, parts: int = 1, standalone: bool = False):
    """Column-split copy of ``module`` (nn.Linear or Conv1D); ``parts`` fused segments (q|k|v)."""
    Column = _cls("column")
    w, b, transposed = dense_weight(module)
    out_f, in_f = w.shape
    new = Column(in_f, out_f, ctx, bias=b is not None, dtype=w.dtype, standalone=standalone).to(w.device)
    _check_partition(new, (out_f // ctx.size, in_f), ctx)
    wl = ShardLayout(tuple(module.weight.shape), 1 if transposed else 0, parts, transposed)
    _copy_(new.weight, wl.shard(module.weight.detach(), ctx.rank, ctx.size))  # stored [out/tp, in]
    mark_distributed(new.weight, wl, ctx)
    new.weight.requires_grad_(module.weight.requires_grad)
    if b is not None:
        bl = ShardLayout(tuple(b.shape), 0, parts)
        _copy_(new.bias, bl.shard(b.detach(), ctx.rank, ctx.size))
        mark_distributed(new.bias, bl, ctx)
        new.bias.requires_grad_(b.requires_grad)
    return new


def row_from_dense(module: nn.Module, ctx, standalone: bool = False):
    """Row-split copy of ``module``; the bias stays whole (added once, after the reduction)."""
    Row = _cls("row")
    w, b, transposed = dense_weight(module)
    out_f, in_f = w.shape
    new = Row(in_f, out_f, ctx, bias=b is not None, dtype=w.dtype, standalone=standalone).to(w.device)
    _check_partition(new, (out_f, in_f // ctx.size), ctx)
    wl = ShardLayout(tuple(module.weight.shape), 0 if transposed else 1, 1, transposed)
    _copy_(new.weight, wl.shard(module.weight.detach(), ctx.rank, ctx.size))  # stored [out, in/tp]
    mark_distributed(new.weight, wl, ctx)
    new.weight.requires_grad_(module.weight.requires_grad)
    if b is not None:
        _copy_(new.bias, b.detach())
        new.bias.requires_grad_(b.requires_grad)
    return new


def vocab_from_embedding(module: nn.Embedding, ctx):
    Vocab = _cls("vocab")
    w = module.weight
    new = Vocab(module.num_embeddings, module.embedding_dim, ctx, padding_idx=module.padding_idx, dtype=w.dtype).to(w.device)
    _check_partition(new, (module.num_embeddings // ctx.size, module.embedding_dim), ctx)
    layout = ShardLayout(tuple(w.shape), 0)
    _copy_(new.weight, layout.shard(w.detach(), ctx.rank, ctx.size))
    mark_distributed(new.weight, layout, ctx)
    new.weight.requires_grad_(w.requires_grad)
    return new


def vocab_head_from_linear(module: nn.Module, ctx, shared_weight: Optional[nn.Parameter] = None):
    """LM head split over the vocabulary (= column split with the output gathered). With
    ``shared_weight`` (the vocab-parallel embedding's shard) the tie of the original is kept."""
    new = column_from_dense(module, ctx, standalone=True)
    if shared_weight is not None:
        del new.weight
        new.weight = shared_weight
    return new

