"""Tensor parallelism for Hugging Face transformer families (spec section 2.11).

A *unit* is the smallest module holding a column-split group and the row-split layer that closes
it: attention (q/k/v column-wise, heads divided across ranks, output projection row-wise) and MLP
(up/gate column-wise, down row-wise), so each pair costs one exchange: on entry of the unit's
*region* (the module whose forward feeds the column layers) the TP group's batch is gathered
(``prescaled_batch=False``; Megatron's ``copy_to`` when prescaled), and the row layer reduce-scatters
(all-reduces) the partial sums back. Units are recognised by class name (own or a base class).

Families: GPT-2 (``Conv1D`` layers, fused q|k|v), Llama / Mistral / Qwen2 / Qwen3, GPT-NeoX (fused
per-head q|k|v), GPT-J, GPT-Neo, BERT / RoBERTa, ViT, T5 (relative attention bias split by head). For a
Hugging Face model that is itself marked, the input embedding and LM head become vocab-parallel
(tied weights stay tied: both use one shard parameter).

Not carried over: attention weights returned with ``output_attentions`` cover the rank's local heads
(and, without prescaling, the TP group's gathered batch); a KV cache holds local heads of the
gathered batch, consistently across calls.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from smp_adapter.parallel import comm, marking
from smp_adapter.parallel.context import using_tp_context
from smp_adapter.parallel.nn import DistributedEmbedding
from smp_adapter.parallel.layers import column_from_dense, dense_sizes, row_from_dense, vocab_from_embedding, vocab_head_from_linear


@dataclass(frozen=True)
class UnitSpec:
    columns: tuple  # ((dotted path, fused parts), ...) relative to the unit
    rows: tuple  # (dotted path, ...)
    region: str = ""  # module whose forward inputs enter the TP region ("" = the unit)
    head_attrs: tuple = ()  # attributes holding head counts / head-derived sizes, divided by tp
    heads: tuple = ()  # ((label, count), ...) that must divide by tp
    head_embeddings: tuple = ()  # nn.Embedding paths whose embedding dim indexes heads (T5)
    local_kwargs: tuple = ()  # forward kwargs already local to the rank (not gathered)
    descend: bool = False  # also visit the unit's children afterwards (BERT layer -> attention)


def _get(root: nn.Module, path: str):
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _cfg(m, *names):
    cfg = getattr(m, "config", None)
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def _gpt2_attention(m):
    if getattr(m, "is_cross_attention", False):
        cols = (("q_attn", 1), ("c_attn", 2))
    else:
        cols = (("c_attn", 3),)
    return UnitSpec(cols, ("c_proj",), head_attrs=("num_heads", "split_size"), heads=(("num_heads", m.num_heads),))


def _llama_attention(m):
    heads = _cfg(m, "num_attention_heads")
    kv = _cfg(m, "num_key_value_heads") or heads
    attrs = tuple(a for a in ("num_heads", "num_key_value_heads") if isinstance(getattr(m, a, None), int))
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("o_proj",), head_attrs=attrs,
                    heads=(("num_attention_heads", heads), ("num_key_value_heads", kv)))


def _gated_mlp(m):
    return UnitSpec((("gate_proj", 1), ("up_proj", 1)), ("down_proj",))


def _neox_attention(m):
    # query_key_value is laid out per head ([heads, 3, head_size]): a contiguous chunk = whole heads
    return UnitSpec((("query_key_value", 1),), ("dense",), heads=(("num_attention_heads", _cfg(m, "num_attention_heads")),))


def _gptj_attention(m):
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("out_proj",),
                    head_attrs=("num_attention_heads",), heads=(("num_attention_heads", m.num_attention_heads),))


def _gptneo_attention(m):
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("out_proj",),
                    head_attrs=("num_heads",), heads=(("num_heads", m.num_heads),))


def _bert_attention(m):
    return UnitSpec((("self.query", 1), ("self.key", 1), ("self.value", 1)), ("output.dense",), region="self",
                    head_attrs=("self.num_attention_heads", "self.all_head_size"),
                    heads=(("num_attention_heads", m.self.num_attention_heads),))


def _bert_layer(m):
    return UnitSpec((("intermediate.dense", 1),), ("output.dense",), region="intermediate", descend=True)


def _vit_attention(m):
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("o_proj",),
                    head_attrs=("num_attention_heads",), heads=(("num_attention_heads", m.num_attention_heads),))


def _t5_attention(m):
    emb = ("relative_attention_bias",) if getattr(m, "has_relative_attention_bias", False) else ()
    return UnitSpec((("q", 1), ("k", 1), ("v", 1)), ("o",), head_attrs=("n_heads", "inner_dim"),
                    heads=(("num_heads", m.n_heads),), head_embeddings=emb, local_kwargs=("position_bias",))


def _mlp(col, row):
    return lambda m: UnitSpec(((col, 1),), (row,))


UNITS: dict[str, Callable] = {
    "GPT2Attention": _gpt2_attention,
    "GPT2MLP": _mlp("c_fc", "c_proj"),
    "GPTNeoXAttention": _neox_attention,
    "GPTNeoXMLP": _mlp("dense_h_to_4h", "dense_4h_to_h"),
    "GPTJAttention": _gptj_attention,
    "GPTJMLP": _mlp("fc_in", "fc_out"),
    "GPTNeoSelfAttention": _gptneo_attention,
    "GPTNeoMLP": _mlp("c_fc", "c_proj"),
    "BertAttention": _bert_attention,
    "BertLayer": _bert_layer,
    "RobertaAttention": _bert_attention,
    "RobertaLayer": _bert_layer,
    "ViTAttention": _vit_attention,
    "ViTMLP": _mlp("fc1", "fc2"),
    "T5Attention": _t5_attention,
    "T5DenseActDense": _mlp("wi", "wo"),
    "T5DenseGatedActDense": lambda m: UnitSpec((("wi_0", 1), ("wi_1", 1)), ("wo",)),
}
for _fam in ("Llama", "Mistral", "Qwen2", "Qwen3"):
    UNITS[f"{_fam}Attention"] = _llama_attention
    UNITS[f"{_fam}MLP"] = _gated_mlp


def unit_spec_for(module: nn.Module) -> Optional[UnitSpec]:
    """The unit spec of a supported Hugging Face module (own class or a base class), else None."""
    for cls in type(module).__mro__:
        build = UNITS.get(cls.__name__)
        if build is not None:
            try:
                spec = build(module)
            except AttributeError:
                return None
            paths = [p for p, _ in spec.columns] + list(spec.rows) + ([spec.region] if spec.region else [])
            if all(_get(module, p) is not None for p in paths):
                return spec
            return None
    return None


def is_hf_model(module: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(module, tf.PreTrainedModel)


# ---------------------------------------------------------------- region entry


class RegionEntry:
    """Forward pre-hook of a unit's region: the inputs of the column layers enter the TP region.

    ``prescaled_batch=False``: every tensor argument whose dim 0 is the batch (>= 2 dims, same size
    as the hidden states') is all-gathered over the TP group (hidden states, masks, position
    embeddings...; gradients are reduce-scattered back). ``prescaled_batch=True``: float tensors that
    require grad pass Megatron's ``copy_to`` (identity forward, all-reduce backward).
    """

    def __init__(self, ctx, local_kwargs=()):
        self.ctx, self.local_kwargs = ctx, frozenset(local_kwargs)

    def _enter(self, t, batch):
        if not isinstance(t, torch.Tensor):
            if isinstance(t, (tuple, list)):
                return type(t)(self._enter(x, batch) for x in t)
            if isinstance(t, dict):
                return {k: self._enter(v, batch) for k, v in t.items()}
            return t
        if self.ctx.prescaled_batch:
            return comm.copy_to_tp(t, self.ctx.group) if t.is_floating_point() and t.requires_grad else t
        if t.dim() >= 2 and t.shape[0] == batch:
            return comm.gather_batch(t, self.ctx.group)
        return t

    def __call__(self, module, args, kwargs):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if not isinstance(first, torch.Tensor):
            return None
        batch = first.shape[0]
        args = tuple(self._enter(a, batch) for a in args)
        kwargs = {k: (v if k in self.local_kwargs else self._enter(v, batch)) for k, v in kwargs.items()}
        return args, kwargs


# ---------------------------------------------------------------- splitting


def _problem(walk, unit, spec: UnitSpec) -> Optional[str]:
    tp = walk.ctx.size
    for label, count in spec.heads:
        if count is None or count % tp:
            return f"{label}={count} is not divisible by the tensor-parallel degree {tp}"
    for path, parts in spec.columns:
        _, out_f = dense_sizes(_get(unit, path))
        if out_f % (tp * parts):
            return f"{path} has {out_f} output features, not divisible by {parts} x {tp}"
    for path in spec.rows:
        in_f, _ = dense_sizes(_get(unit, path))
        if in_f % tp:
            return f"{path} has {in_f} input features, not divisible by the tensor-parallel degree {tp}"
    other = walk.shared_with(unit)
    if other is not None:
        return f"it shares parameters with {other}"
    return None


def split_unit(walk, unit: nn.Module, qname: str, spec: UnitSpec) -> None:
    why = _problem(walk, unit, spec)
    if why:
        walk.warn(qname, unit, why)
        return
    ctx = walk.ctx
    for path, parts in spec.columns:
        old = _get(unit, path)
        walk.replace(old, column_from_dense(old, ctx, parts=parts))
    for path in spec.rows:
        old = _get(unit, path)
        walk.replace(old, row_from_dense(old, ctx))
    for path in spec.head_embeddings:
        old = _get(unit, path)
        with using_tp_context(ctx):  # local lookup of this rank's heads: no communication
            new = DistributedEmbedding(old.num_embeddings, old.embedding_dim, _weight=old.weight.detach(),
                                       _skip_allgather=True, _skip_scatter_and_merge=True)
        new.weight.requires_grad_(old.weight.requires_grad)
        walk.replace(old, new.to(old.weight.device))
    for attr in spec.head_attrs:
        owner_path, _, name = attr.rpartition(".")
        owner = _get(unit, owner_path)
        value = getattr(owner, name, None)
        if isinstance(value, int):
            setattr(owner, name, value // ctx.size)
    region = _get(unit, spec.region)
    region.register_forward_pre_hook(RegionEntry(ctx, spec.local_kwargs), with_kwargs=True)
    walk.names.append(qname)


def _qualified(model: nn.Module, target: nn.Module, prefix: str) -> str:
    for name, m in model.named_modules():
        if m is target:
            return prefix + name if name else prefix.rstrip(".")
    return prefix + "?"


def _enabled(m: nn.Module) -> bool:
    mark = marking.get_mark(m)
    return mark is not None and mark.enabled


def split_embeddings(walk, model: nn.Module, qname: str) -> None:
    """Vocab-parallel input embedding + LM head of a marked Hugging Face model.

    Tied weights stay tied: every module owning the word-embedding weight (T5's ``shared`` and its
    encoder/decoder ``embed_tokens``, a tied ``lm_head``) is replaced and they share one shard.
    """
    try:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return
    prefix = qname + "." if qname else ""
    tp = walk.ctx.size
    head = head if isinstance(head, nn.Linear) and _enabled(head) and id(head) not in walk.settled else None
    emb = emb if isinstance(emb, nn.Embedding) and _enabled(emb) and id(emb) not in walk.settled else None
    if head is not None and not (emb is not None and head.weight is emb.weight):
        _split_head(walk, head, _qualified(model, head, prefix))
    if emb is None:
        return
    owners = walk.owners.get(id(emb.weight), [])  # (name from the walk's root, module)
    members = {id(m) for _, m in owners}

    def leave_whole(why):
        for mq, m in owners:
            walk.warn(mq, m, why)

    for mq, m in owners:  # every owner of the word-embedding weight must be splittable and marked
        if not _enabled(m) or not (isinstance(m, nn.Embedding) or (isinstance(m, nn.Linear) and m is head)):
            return leave_whole(f"the word-embedding weight is shared with {mq}, which is not marked for tensor "
                               "parallelism or is not an embedding / the LM head")
        for p in m.parameters():
            for oq, owner in walk.owners.get(id(p), []):
                if id(owner) not in members:
                    return leave_whole(f"{mq} shares parameters with {oq}")
        if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.sparse or m.scale_grad_by_freq):
            return leave_whole(f"{mq}: max_norm, sparse and scale_grad_by_freq are not supported by the "
                               "vocab-parallel embedding")
    if emb.num_embeddings % tp:
        return leave_whole(f"the vocabulary ({emb.num_embeddings}) is not divisible by the tensor-parallel degree {tp}")
    shard = None
    for mq, m in sorted(owners, key=lambda o: not isinstance(o[1], nn.Embedding)):  # embeddings, then the head
        if isinstance(m, nn.Embedding):
            new = vocab_from_embedding(m, walk.ctx)
            if shard is None:
                shard = new.weight
            else:
                del new.weight
                new.weight = shard
        else:
            new = vocab_head_from_linear(m, walk.ctx, shared_weight=shard)
        walk.replace(m, new)
        walk.names.append(mq)


def _split_head(walk, head: nn.Linear, hq: str) -> None:
    tp = walk.ctx.size
    if head.out_features % tp:
        walk.warn(hq, head, f"the vocabulary ({head.out_features}) is not divisible by the tensor-parallel degree {tp}")
        return
    other = walk.shared_with(head)
    if other is not None:
        walk.warn(hq, head, f"it shares parameters with {other}")
        return
    walk.replace(head, vocab_head_from_linear(head, walk.ctx))
    walk.names.append(hq)
