"""``smp.nn.FusedLayerNorm`` and ``smp.nn.FlashAttentionLayer`` without apex or Triton.

The public AWS GPT and BERT scripts import ``FusedLayerNorm`` at module level, build models with it
(BERT's ``BertLayerNorm``) and use it in ``isinstance`` checks to keep norm weights out of weight
decay. smp v1's own transformer layers were built from it, so in those scripts every norm of a
model created for tensor parallelism passed that check. smp-adapter keeps Hugging Face's
``nn.LayerNorm`` modules, so ``isinstance(m, FusedLayerNorm)`` is true for any ``nn.LayerNorm``:
the scripts then group parameters as they did under smp v1.

``FlashAttentionLayer`` computes attention with ``torch.nn.functional.scaled_dot_product_attention``
(a fused kernel where PyTorch has one for the device and dtype, plain math otherwise).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError


class _LayerNormCheck(type(nn.LayerNorm)):
    def __instancecheck__(cls, obj):
        return isinstance(obj, nn.LayerNorm) if cls is FusedLayerNorm else super().__instancecheck__(obj)


class FusedLayerNorm(nn.LayerNorm, metaclass=_LayerNormCheck):
    """apex ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: LayerNorm
    semantics (torch's kernel, fused on GPUs)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, **kwargs):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kwargs)


class FlashAttentionLayer(nn.Module):
    """smp v1.15's attention core: ``forward(qkv [B, S, 3, H, D], attn_mask=None, causal=False)`` ->
    ``[B, H, S, D]``.

    Scale: ``scale`` when given; else ``1/sqrt(attention_head_size or D)`` if
    ``scale_attention_scores``, further divided by ``layer_idx + 1`` with
    ``scale_attn_by_layer_idx``; else 1. ``attn_mask``: an additive float mask or a boolean mask
    (True = attend) broadcastable to ``[B, H, S, S]``. Attention dropout applies in training mode.
    """

    def __init__(self, attention_dropout_prob=0.1, attention_head_size=None, scale_attention_scores=True,
                 scale_attn_by_layer_idx=False, layer_idx=None, scale=None, triton_flash_attention=False,
                 use_alibi=False):
        super().__init__()
        if use_alibi:
            raise UnsupportedFeatureError(
                "FlashAttentionLayer(use_alibi=True) needs smp's Triton kernel, which smp-adapter does not have: use a "
                "Hugging Face model with ALiBi (BLOOM, MPT) inside smp.tensor_parallelism(), or position embeddings")
        if scale_attn_by_layer_idx and layer_idx is None:
            raise SMPUsageError("FlashAttentionLayer(scale_attn_by_layer_idx=True) needs layer_idx")
        self.dropout_p = attention_dropout_prob
        self.attention_head_size = attention_head_size
        self.scale_attention_scores = scale_attention_scores
        self.scale_attn_by_layer_idx = scale_attn_by_layer_idx
        self.layer_idx = layer_idx
        self.scale = scale
        # triton_flash_attention: accepted; the fused kernel is whatever SDPA picks for the device

    def softmax_scale(self, head_dim: int) -> float:
        if self.scale is not None:
            return float(self.scale)
        if not self.scale_attention_scores:
            return 1.0
        scale = 1.0 / math.sqrt(self.attention_head_size or head_dim)
        if self.scale_attn_by_layer_idx:
            scale /= self.layer_idx + 1
        return scale

    def forward(self, qkv: torch.Tensor, attn_mask=None, causal: bool = False) -> torch.Tensor:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise SMPUsageError(f"FlashAttentionLayer expects qkv of shape [batch, seq, 3, heads, head_dim], got "
                                f"{tuple(qkv.shape)}")
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each [B, H, S, D]
        if causal and attn_mask is not None:  # SDPA takes a mask or is_causal, not both
            attn_mask, causal = _with_causal(attn_mask, q), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                              dropout_p=self.dropout_p if self.training else 0.0,
                                              scale=self.softmax_scale(q.shape[-1]))


def _with_causal(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A user mask combined with the causal one (SDPA takes one or the other)."""
    s = q.shape[-2]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    if mask.dtype == torch.bool:
        return mask & ~future
    return mask.to(q.dtype).masked_fill(future, torch.finfo(q.dtype).min)
