"""``smp.nn`` transformer modules, built from the shard layers.

Choices where the spec leaves room (section 5.17/5.18), checked against Hugging Face BERT (post-LN)
and GPT-2 (pre-LN, causal) layers in the tests:

* ``attention_head_size`` is honoured (q/k/v project ``hidden -> heads * attention_head_size``);
  the appendix's recomputation ``hidden_size // num_attention_heads`` is not copied.
* Every non-attention dropout uses ``hidden_dropout_prob`` (the argument docs), not the
  appendix's ``attention_dropout_prob`` in the output layer.
* Residual connections are always added; ``post_layernorm`` normalises ``input + sublayer(x)``,
  ``pre_layernorm`` normalises the sublayer's input (x = LN(input)).
* Masks are additive ``[N, 1, 1, S]`` tensors (0 = keep, large negative = masked), as at the layer
  level in the spec; ``causal_mask_size`` additionally masks future positions (self-attention only).
* ``DistributedTransformer.forward`` returns the same tuple its layers do.
* ``DistributedTransformerLMHead``: its return value and parameter names are not documented;
  smp-adapter's choices are in its docstring (mask: 1 = masked, as the smp docs say; returns the
  logits, or ``(loss, logits)`` with labels).

Weights are initialised on the full matrix and sliced (normal(0, initializer_range) with zero bias
when ``use_normal_initialization``, else PyTorch's default), so TP ranks seeded alike hold the
slices of one full layer, and ranks seeded by ``dp_rank`` (smp's advice) hold independent slices.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError
from smp_adapter.parallel import comm
from smp_adapter.parallel.layers import column_from_dense, enter_region, row_from_dense
from smp_adapter.parallel.context import DistributedModule

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


def _dense(in_f, out_f, normal: bool, std: float) -> nn.Linear:
    lin = nn.Linear(in_f, out_f)
    if normal:
        nn.init.normal_(lin.weight, 0.0, std)
        nn.init.zeros_(lin.bias)
    return lin


def _check(value, what, tp):
    if value % tp:
        raise SMPUsageError(f"{what}={value} is not divisible by the tensor-parallel degree {tp}")


def _enter(t, ctx, batch):
    """A TP-region input: gathered over the TP group (own batches) or copied in (prescaled)."""
    if t is None:
        return None
    if ctx.prescaled_batch:
        return comm.copy_to_tp(t, ctx.group) if t.is_floating_point() and t.requires_grad else t
    return comm.gather_batch(t, ctx.group) if t.shape[0] == batch else t


def _add_layernorms(module: nn.Module, hidden_size: int, eps: float, pre: bool, post: bool) -> None:
    """smp's ``pre_layernorm`` / ``post_layernorm`` switches: the LayerNorm modules (under smp's names,
    which checkpoints carry) and the flags forward reads."""
    if pre:
        module.pre_layernorm = nn.LayerNorm(hidden_size, eps=eps)
    if post:
        module.layernorm = nn.LayerNorm(hidden_size, eps=eps)
    module.use_pre_layernorm, module.use_post_layernorm = pre, post


class DistributedAttentionLayer(DistributedModule):
    def __init__(self, num_attention_heads=32, attention_head_size=32, hidden_size=1024, attention_dropout_prob=0.1,
                 hidden_dropout_prob=0.1, layernorm_epsilon=1e-5, initializer_range=0.02,
                 use_normal_initialization=False, cross_attention=False, causal_mask_size=None,
                 pre_layernorm=False, post_layernorm=True):
        super().__init__()
        ctx = self.tp_context
        _check(num_attention_heads, "num_attention_heads", ctx.size)
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.local_heads = num_attention_heads // ctx.size
        self.hidden_size, self.cross_attention = hidden_size, cross_attention
        self.causal_mask_size = None if cross_attention else causal_mask_size
        inner = num_attention_heads * attention_head_size
        n, std = use_normal_initialization, initializer_range
        self.query = column_from_dense(_dense(hidden_size, inner, n, std), ctx)
        self.key = column_from_dense(_dense(hidden_size, inner, n, std), ctx)
        self.value = column_from_dense(_dense(hidden_size, inner, n, std), ctx)
        self.dense = row_from_dense(_dense(inner, hidden_size, n, std), ctx)
        self.attention_dropout = nn.Dropout(attention_dropout_prob)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        _add_layernorms(self, hidden_size, layernorm_epsilon, pre_layernorm, post_layernorm)

    def _heads(self, x):
        n, s = x.shape[:2]
        return x.view(n, s, self.local_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, inputs):
        if self.cross_attention:
            hidden, cross_states, mask = inputs
        else:
            (hidden, mask), cross_states = inputs, None
        ctx, batch = self.tp_context, hidden.shape[0]
        x = self.pre_layernorm(hidden) if self.use_pre_layernorm else hidden
        x = enter_region(x, ctx)
        kv = _enter(cross_states, ctx, batch) if self.cross_attention else x
        mask = _enter(mask, ctx, batch)
        q, k, v = self._heads(self.query(x)), self._heads(self.key(kv)), self._heads(self.value(kv))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if mask is not None:
            scores = scores + mask
        if self.causal_mask_size is not None:
            s_q, s_k = scores.shape[-2:]
            if s_k > self.causal_mask_size:
                raise SMPUsageError(f"sequence length {s_k} exceeds causal_mask_size={self.causal_mask_size}")
            future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1 + s_k - s_q)
            scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        out = self.dropout(self.dense(context)) + hidden
        return self.layernorm(out) if self.use_post_layernorm else out


class DistributedTransformerOutputLayer(DistributedModule):
    def __init__(self, hidden_size=1024, intermediate_size=4096, hidden_dropout_prob=0.1, activation="gelu",
                 layernorm_epsilon=1e-5, initializer_range=0.02, use_normal_initialization=False,
                 pre_layernorm=False, post_layernorm=True, fp32_residual_addition=False):
        super().__init__()
        ctx = self.tp_context
        if activation not in _ACTIVATIONS:
            raise SMPUsageError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        _check(intermediate_size, "intermediate_size", ctx.size)
        n, std = use_normal_initialization, initializer_range
        self.dense1 = column_from_dense(_dense(hidden_size, intermediate_size, n, std), ctx)
        self.dense2 = row_from_dense(_dense(intermediate_size, hidden_size, n, std), ctx)
        self.activation = activation
        self.dropout = nn.Dropout(hidden_dropout_prob)
        _add_layernorms(self, hidden_size, layernorm_epsilon, pre_layernorm, post_layernorm)
        self.fp32_residual_addition = fp32_residual_addition

    def forward(self, hidden):
        x = self.pre_layernorm(hidden) if self.use_pre_layernorm else hidden
        x = enter_region(x, self.tp_context)
        y = self.dropout(self.dense2(_ACTIVATIONS[self.activation](self.dense1(x))))
        out = (y.float() + hidden.float()).to(hidden.dtype) if self.fp32_residual_addition else y + hidden
        return self.layernorm(out) if self.use_post_layernorm else out


class DistributedTransformerLayer(DistributedModule):
    def __init__(self, num_attention_heads=32, attention_head_size=32, hidden_size=1024, intermediate_size=4096,
                 attention_dropout_prob=0.1, hidden_dropout_prob=0.1, activation="gelu", layernorm_epsilon=1e-5,
                 initializer_range=0.02, use_normal_initialization=False, causal_mask_size=None,
                 add_cross_attention=False, pre_layernorm=False, post_layernorm=True, use_alibi=False,
                 alibi_bias_max=8, fp32_residual_addition=False):
        super().__init__()
        if not (pre_layernorm or post_layernorm):
            raise SMPUsageError("DistributedTransformerLayer needs pre_layernorm or post_layernorm (or both)")
        if use_alibi:
            raise UnsupportedFeatureError(
                "DistributedTransformerLayer(use_alibi=True) is not supported; use a Hugging Face model with "
                "ALiBi (e.g. BLOOM/MPT) inside smp.tensor_parallelism(), or position embeddings")
        attn = dict(num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
                    hidden_size=hidden_size, attention_dropout_prob=attention_dropout_prob,
                    hidden_dropout_prob=hidden_dropout_prob, layernorm_epsilon=layernorm_epsilon,
                    initializer_range=initializer_range, use_normal_initialization=use_normal_initialization,
                    pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
        self.attention = DistributedAttentionLayer(causal_mask_size=causal_mask_size, **attn)
        self.add_cross_attention = add_cross_attention
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **attn)
        self.output = DistributedTransformerOutputLayer(
            hidden_size=hidden_size, intermediate_size=intermediate_size, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, fp32_residual_addition=fp32_residual_addition)

    def forward(self, inputs):
        if self.add_cross_attention:
            hidden, cross_states, mask, cross_mask = inputs
            hidden = self.attention((hidden, mask))
            hidden = self.cross_attention((hidden, cross_states, cross_mask))
            return self.output(hidden), cross_states, mask, cross_mask
        hidden, mask = inputs
        return self.output(self.attention((hidden, mask))), mask


class DistributedTransformer(DistributedModule):
    def __init__(self, num_layers=12, num_attention_heads=32, attention_head_size=32, hidden_size=1024,
                 intermediate_size=4096, attention_dropout_prob=0.1, hidden_dropout_prob=0.1, activation="gelu",
                 layernorm_epsilon=1e-5, initializer_range=0.02, use_normal_initialization=False,
                 causal_mask_size=None, add_cross_attention=False, pre_layernorm=False, post_layernorm=True,
                 **layer_kwargs):
        super().__init__()
        kw = dict(num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
                  hidden_size=hidden_size, intermediate_size=intermediate_size,
                  attention_dropout_prob=attention_dropout_prob, hidden_dropout_prob=hidden_dropout_prob,
                  activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
                  use_normal_initialization=use_normal_initialization, causal_mask_size=causal_mask_size,
                  add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm,
                  post_layernorm=post_layernorm, **layer_kwargs)
        self.seq_layers = nn.Sequential(*[DistributedTransformerLayer(**kw) for _ in range(num_layers)])
        self.block_layernorms = pre_layernorm and post_layernorm
        if self.block_layernorms:  # spec: with both set, the block's input and output are normalised too
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inputs):
        if self.block_layernorms:
            inputs = (self.pre_layernorm(inputs[0]),) + tuple(inputs[1:])
        out = self.seq_layers(tuple(inputs))
        if self.block_layernorms:
            out = (self.layernorm(out[0]),) + tuple(out[1:])
        return out


class DistributedTransformerLMHead(DistributedModule):
    """Embeddings + ``DistributedTransformer`` + LM head tied to the word embedding.

    Where smp v1's documentation is silent, smp-adapter's choices:

    * parameters: ``word_embedding`` (vocabulary split over TP ranks, so ``vocab_size`` must divide
      by the TP degree), ``position_embedding`` and ``token_type_embedding`` (whole on every rank),
      ``transformer`` (with ``seq_layers``), ``lm_head`` (its weight *is* the word embedding's);
    * ``attention_mask`` follows the smp documentation: ``[N, S]``, **1 marks a masked position**
      (the opposite of Hugging Face's); ``None`` masks nothing;
    * the return value is the logits ``[N, S, vocab_size]`` (hidden states ``[N, S, H]`` without the
      LM head); when ``labels`` are given, ``(loss, logits)`` with the mean cross entropy over labels
      other than -100, next-token shifted when ``causal_mask_size`` is set (GPT), unshifted otherwise
      (masked-LM, BERT).
    """

    def __init__(self, num_layers=12, num_attention_heads=32, attention_head_size=32, hidden_size=1024,
                 intermediate_size=4096, vocab_size=30522, num_positions=1024, attention_dropout_prob=0.1,
                 hidden_dropout_prob=0.1, activation="gelu", layernorm_epsilon=1e-5, num_token_types=0,
                 causal_mask_size=None, add_cross_attention=False, add_lm_head=True, initializer_range=0.02,
                 use_normal_initialization=False, pre_layernorm=False, post_layernorm=True):
        super().__init__()
        from smp_adapter.parallel.layers import vocab_from_embedding, vocab_head_from_linear

        ctx = self.tp_context
        if vocab_size % ctx.size:
            raise SMPUsageError(f"DistributedTransformerLMHead: vocab_size={vocab_size} is not divisible by the "
                                f"tensor-parallel degree {ctx.size}: pad the vocabulary to a multiple of it")
        std = initializer_range

        def embedding(n):
            emb = nn.Embedding(n, hidden_size)
            nn.init.normal_(emb.weight, 0.0, std)  # both smp init modes draw embeddings from N(0, std)
            return emb

        self.word_embedding = vocab_from_embedding(embedding(vocab_size), ctx)
        self.position_embedding = embedding(num_positions)
        self.token_type_embedding = embedding(num_token_types) if num_token_types > 0 else None
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.add_cross_attention, self.causal_mask_size = add_cross_attention, causal_mask_size
        self.transformer = DistributedTransformer(
            num_layers=num_layers, num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
            hidden_size=hidden_size, intermediate_size=intermediate_size, attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob, activation=activation, layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range, use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size, add_cross_attention=add_cross_attention,
            pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
        self.lm_head = None
        if add_lm_head:
            self.lm_head = vocab_head_from_linear(nn.Linear(hidden_size, vocab_size, bias=False), ctx,
                                                  shared_weight=self.word_embedding.weight)

    @staticmethod
    def _additive(mask, dtype):
        """smp's [N, S] mask (1 = masked) -> the layers' additive [N, 1, 1, S] mask."""
        if mask is None:
            return None
        return mask.to(dtype)[:, None, None, :] * torch.finfo(dtype).min

    def forward(self, inputs):
        inputs = tuple(inputs)
        expected = 7 if self.add_cross_attention else 5
        if len(inputs) != expected:
            names = ("input_ids, attention_mask, token_type_ids, position_ids, cross_states, cross_mask, labels"
                     if self.add_cross_attention else "input_ids, attention_mask, token_type_ids, position_ids, labels")
            raise SMPUsageError(f"DistributedTransformerLMHead.forward takes one tuple ({names}); got {len(inputs)} "
                                "items: pass None for the ones you do not use")
        input_ids, mask, token_types, positions = inputs[:4]
        labels = inputs[-1]
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.word_embedding(input_ids) + self.position_embedding(positions)
        if self.token_type_embedding is not None and token_types is not None:
            hidden = hidden + self.token_type_embedding(token_types)
        hidden = self.dropout(hidden)
        if self.add_cross_attention:
            cross_states, cross_mask = inputs[4], inputs[5]
            out = self.transformer((hidden, cross_states, self._additive(mask, hidden.dtype),
                                    self._additive(cross_mask, hidden.dtype)))
        else:
            out = self.transformer((hidden, self._additive(mask, hidden.dtype)))
        hidden = out[0]
        if self.lm_head is None:
            return hidden
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        if self.causal_mask_size is not None:
            logits_for_loss, labels = logits[:, :-1], labels[:, 1:]
        else:
            logits_for_loss = logits
        loss = F.cross_entropy(logits_for_loss.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=-100)
        return loss, logits
