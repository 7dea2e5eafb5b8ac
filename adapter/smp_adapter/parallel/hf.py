"""Tensor parallelism for Hugging Face transformer families.

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


# Kinds of head-derived sizes a unit's attributes hold (divided by the tensor-parallel degree).
HEADS, KV_HEADS, WIDTH = "heads", "kv_heads", "width"


@dataclass(frozen=True)
class UnitSpec:
    columns: tuple  # ((dotted path, fused parts), ...) relative to the unit
    rows: tuple  # (dotted path, ...)
    region: str = ""  # module whose forward inputs enter the TP region ("" = the unit)
    # ((attribute path, kind), ...): attributes holding head counts / head-derived widths, divided by
    # tp when they hold the config's full size of that kind (see _local_sizes)
    head_attrs: tuple = ()
    heads: tuple = ()  # ((label, count), ...) that must divide by tp
    head_embeddings: tuple = ()  # nn.Embedding paths whose embedding dim indexes heads (T5)
    local_kwargs: tuple = ()  # forward kwargs already local to the rank (not gathered)
    descend: bool = False  # also visit the unit's children afterwards (BERT layer -> attention)
    sizes: Optional["HeadSizes"] = None  # the model's head sizes, from its config (attention units)


@dataclass(frozen=True)
class HeadSizes:
    """An attention's full sizes, read from the model's config.

    The config's names are stable across transformers releases (``attribute_map`` maps GPT-2's
    ``n_head``, GPT-Neo's and T5's ``num_heads``, T5's ``d_model`` to ``num_attention_heads`` /
    ``hidden_size``); the module attributes holding them are not (GPT2SdpaAttention in 4.41-4.47
    reads ``embed_dim`` in its forward, 5.x does not; Llama < 4.46 reads ``hidden_size``).
    """

    heads: int
    kv_heads: int
    head_dim: int

    @property
    def width(self) -> int:  # the q (and attention output) width: heads x head_dim
        return self.heads * self.head_dim

    def of(self, kind: str) -> int:
        return {HEADS: self.heads, KV_HEADS: self.kv_heads, WIDTH: self.width}[kind]

    def checks(self) -> tuple:
        both = (("num_attention_heads", self.heads),)
        return both + ((("num_key_value_heads", self.kv_heads),) if self.kv_heads != self.heads else ())


def head_sizes(cfg) -> HeadSizes:
    """The attention sizes of a Hugging Face config; AttributeError when it has none."""
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        raise AttributeError("the model's config has no num_attention_heads")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    # explicit head_dim (Llama family from 4.46, Qwen3), T5's d_kv, else hidden_size / heads
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "d_kv", None) or cfg.hidden_size // heads
    return HeadSizes(heads, kv, head_dim)


def _get(root: nn.Module, path: str):
    obj = root
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# Each builder takes (unit, sizes): sizes from the enclosing model's config. The attribute lists are
# the union over the supported transformers releases: an attribute a release does not have is
# skipped, one holding another value than the config's full size is not that size in that release.


def _gpt2_attention(m, s):
    if getattr(m, "is_cross_attention", False):
        cols = (("q_attn", 1), ("c_attn", 2))
    else:
        cols = (("c_attn", 3),)
    # embed_dim: GPT2SdpaAttention (4.41-4.47) views its output as (batch, seq, embed_dim)
    return UnitSpec(cols, ("c_proj",), head_attrs=(("num_heads", HEADS), ("split_size", WIDTH), ("embed_dim", WIDTH)),
                    heads=s.checks(), sizes=s)


def _llama_attention(m, s):
    # hidden_size: < 4.46 reshapes the attention output to (batch, seq, hidden_size) (= heads x head_dim)
    attrs = (("num_heads", HEADS), ("num_key_value_heads", KV_HEADS), ("hidden_size", WIDTH))
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("o_proj",), head_attrs=attrs,
                    heads=s.checks(), sizes=s)


def _gated_mlp(m, s):
    return UnitSpec((("gate_proj", 1), ("up_proj", 1)), ("down_proj",))


def _neox_attention(m, s):
    # query_key_value is laid out per head ([heads, 3, head_size]): a contiguous chunk = whole heads.
    # 4.x views it with num_attention_heads; 4.41-4.47's SDPA path views its output with hidden_size
    return UnitSpec((("query_key_value", 1),), ("dense",),
                    head_attrs=(("num_attention_heads", HEADS), ("hidden_size", WIDTH)), heads=s.checks(), sizes=s)


def _gptj_attention(m, s):
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("out_proj",),
                    head_attrs=(("num_attention_heads", HEADS), ("embed_dim", WIDTH)), heads=s.checks(), sizes=s)


def _gptneo_attention(m, s):
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("out_proj",),
                    head_attrs=(("num_heads", HEADS), ("embed_dim", WIDTH)), heads=s.checks(), sizes=s)


def _bert_attention(m, s, inner="self"):
    return UnitSpec(((f"{inner}.query", 1), (f"{inner}.key", 1), (f"{inner}.value", 1)), ("output.dense",),
                    region=inner, head_attrs=((f"{inner}.num_attention_heads", HEADS), (f"{inner}.all_head_size", WIDTH)),
                    heads=s.checks(), sizes=s)


def _bert_layer(m, s):
    return UnitSpec((("intermediate.dense", 1),), ("output.dense",), region="intermediate", descend=True)


def _vit_attention(m, s):
    if _get(m, "attention.query") is not None:  # transformers 4.x: BERT's layout under other names
        return _bert_attention(m, s, inner="attention")
    return UnitSpec((("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), ("o_proj",),
                    head_attrs=(("num_attention_heads", HEADS),), heads=s.checks(), sizes=s)


def _t5_attention(m, s):
    emb = ("relative_attention_bias",) if getattr(m, "has_relative_attention_bias", False) else ()
    return UnitSpec((("q", 1), ("k", 1), ("v", 1)), ("o",), head_attrs=(("n_heads", HEADS), ("inner_dim", WIDTH)),
                    heads=s.checks(), head_embeddings=emb, local_kwargs=("position_bias",), sizes=s)


def _mlp(col, row):
    return lambda m, s: UnitSpec(((col, 1),), (row,))


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
    "ViTMLP": _mlp("fc1", "fc2"),  # transformers 5.x
    "ViTLayer": _bert_layer,  # transformers 4.x: the MLP is the layer's intermediate.dense / output.dense
    "T5Attention": _t5_attention,
    "T5DenseActDense": _mlp("wi", "wo"),
    "T5DenseGatedActDense": lambda m, s: UnitSpec((("wi_0", 1), ("wi_1", 1)), ("wo",)),
}
for _fam in ("Llama", "Mistral", "Qwen2", "Qwen3"):
    UNITS[f"{_fam}Attention"] = _llama_attention
    UNITS[f"{_fam}MLP"] = _gated_mlp


def unit_spec_for(module: nn.Module, config=None) -> Optional[UnitSpec]:
    """The unit spec of a supported Hugging Face module (own class or a base class), else None.

    ``config``: the enclosing Hugging Face model's config (modules of transformers 4.x mostly keep
    none of their own); the module's own ``config`` when not given.
    """
    for cls in type(module).__mro__:
        build = UNITS.get(cls.__name__)
        if build is not None:
            try:
                spec = build(module, head_sizes(config if config is not None else module.config))
            except AttributeError:
                return None
            paths = [p for p, _ in spec.columns] + list(spec.rows) + ([spec.region] if spec.region else [])
            if all(_get(module, p) is not None for p in paths):
                return spec
            return None
    return None


def configs_by_module(root: nn.Module) -> dict:
    """id(module) -> config of the innermost Hugging Face model containing it (for unit_spec_for)."""
    found = {}
    for m in root.modules():  # pre-order: an inner model's config overrides its outer model's
        if is_hf_model(m):
            for sub in m.modules():
                found[id(sub)] = m.config
    return found


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
    _local_sizes(unit, spec, ctx.size)
    region = _get(unit, spec.region)
    region.register_forward_pre_hook(RegionEntry(ctx, spec.local_kwargs), with_kwargs=True)
    walk.names.append(qname)


def _local_sizes(unit: nn.Module, spec: UnitSpec, tp: int) -> None:
    """Divide the unit's head-derived attributes that hold the config's full size by ``tp``."""
    for attr, kind in spec.head_attrs:
        owner_path, _, name = attr.rpartition(".")
        owner = _get(unit, owner_path)
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value == spec.sizes.of(kind):
            setattr(owner, name, value // tp)


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
