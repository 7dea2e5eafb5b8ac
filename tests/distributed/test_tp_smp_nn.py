"""smp.nn modules built directly, with tensor parallelism 2 on CPU/gloo: DistributedLinear and
DistributedEmbedding against their unsplit torch equivalents, and DistributedTransformer /
DistributedTransformerLayer against Hugging Face BERT (post-LN) and GPT-2 (pre-LN, causal) layers
with the same weights, for prescaled_batch False and True."""

from __future__ import annotations

import pytest
import torch

from spawn import run_distributed
from tp_asserts import assert_close, hf_quiet

pytestmark = pytest.mark.distributed


# ---------------------------------------------------------------- smp.nn modules built directly


def _smp_nn_body(rank, world):
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from smp_adapter.parallel.nn import DistributedEmbedding, DistributedLinear
    from smp_adapter.parallel.tensor import TPContext, gather_full_state_dict, set_current_tp_context

    for prescaled in (False, True):
        ctx = TPContext(dist.group.WORLD, rank, world, prescaled)
        set_current_tp_context(ctx)
        torch.manual_seed(5 + rank)  # shards are initialised independently, as with smp's dp_rank seeding
        lin = DistributedLinear(8, 6)
        emb = DistributedEmbedding(16, 8, padding_idx=3)
        assert tuple(lin.weight.shape) == (6, 8 // world) and tuple(emb.weight.shape) == (16, 8 // world)
        # the unsplit equivalents, from the gathered state
        ref_lin, ref_emb = nn.Linear(8, 6), nn.Embedding(16, 8, padding_idx=3)
        ref_lin.load_state_dict(gather_full_state_dict(lin, ctx))
        ref_emb.load_state_dict(gather_full_state_dict(emb, ctx))
        gen = torch.Generator().manual_seed(0 if prescaled else rank)
        ids = torch.randint(0, 16, (3, 5), generator=gen)
        ids[0, 0] = 3
        x = emb(ids)
        assert_close("DistributedEmbedding", x, ref_emb(ids))
        y = lin(x)
        assert_close("DistributedLinear", y, ref_lin(ref_emb(ids)))
        y.square().sum().backward()
        assert emb.weight.grad[3].abs().max() == 0, "padding row got a gradient"
    set_current_tp_context(None)
    return True


def test_smp_nn_modules_tp2():
    assert run_distributed(_smp_nn_body, 2) == [True, True]


# ---------------------------------------------------------------- smp.nn transformer layers vs Hugging Face


def _bert_to_smp(sd, prefix=""):
    """BertLayer state dict -> DistributedTransformerLayer keys (post-LN)."""
    m = {"attention.self.query": "attention.query", "attention.self.key": "attention.key",
         "attention.self.value": "attention.value", "attention.output.dense": "attention.dense",
         "attention.output.LayerNorm": "attention.layernorm", "intermediate.dense": "output.dense1",
         "output.dense": "output.dense2", "output.LayerNorm": "output.layernorm"}
    out = {}
    for k, v in sd.items():
        mod, _, leaf = k.rpartition(".")
        out[prefix + m[mod] + "." + leaf] = v
    return out


def _gpt2_block_to_smp(sd, hidden):
    """GPT2Block state dict (Conv1D weights are [in, out]) -> DistributedTransformerLayer keys (pre-LN)."""
    q, k, v = sd["attn.c_attn.weight"].t().chunk(3, 0)
    qb, kb, vb = sd["attn.c_attn.bias"].chunk(3, 0)
    return {
        "attention.pre_layernorm.weight": sd["ln_1.weight"], "attention.pre_layernorm.bias": sd["ln_1.bias"],
        "attention.query.weight": q, "attention.query.bias": qb, "attention.key.weight": k, "attention.key.bias": kb,
        "attention.value.weight": v, "attention.value.bias": vb,
        "attention.dense.weight": sd["attn.c_proj.weight"].t(), "attention.dense.bias": sd["attn.c_proj.bias"],
        "output.pre_layernorm.weight": sd["ln_2.weight"], "output.pre_layernorm.bias": sd["ln_2.bias"],
        "output.dense1.weight": sd["mlp.c_fc.weight"].t(), "output.dense1.bias": sd["mlp.c_fc.bias"],
        "output.dense2.weight": sd["mlp.c_proj.weight"].t(), "output.dense2.bias": sd["mlp.c_proj.bias"],
    }


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _smp_transformer_body(rank, world):
    import torch.distributed as dist
    import transformers as tf
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from smp_adapter.parallel.nn import DistributedTransformer, DistributedTransformerLayer
    from smp_adapter.parallel.tensor import TPContext, gather_full_state_dict, set_current_tp_context, shard_state_dict

    hf_quiet()
    for prescaled in (False, True):
        ctx = TPContext(dist.group.WORLD, rank, world, prescaled)
        set_current_tp_context(ctx)
        gen = torch.Generator().manual_seed(0 if prescaled else 10 + rank)

        # two post-LN BERT layers == DistributedTransformer(num_layers=2) with an additive padding mask
        torch.manual_seed(0)
        bcfg = tf.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, hidden_act="gelu",
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
        bcfg._attn_implementation = "eager"
        ref_layers = [BertLayer(bcfg).eval() for _ in range(2)]
        smp = DistributedTransformer(num_layers=2, num_attention_heads=4, attention_head_size=8, hidden_size=32,
                                     intermediate_size=64, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                                     layernorm_epsilon=1e-12).eval()
        assert len(smp.seq_layers) == 2 and hasattr(smp.seq_layers[0].attention, "query")
        full = {}
        for i, layer in enumerate(ref_layers):
            full.update(_bert_to_smp(layer.state_dict(), f"seq_layers.{i}."))
        smp.load_state_dict(shard_state_dict(smp, full, ctx), strict=True)
        assert tuple(smp.seq_layers[0].attention.query.weight.shape) == (32 // world, 32)
        assert tuple(smp.seq_layers[0].output.dense2.weight.shape) == (32, 64 // world)
        x = torch.randn(2, 6, 32, generator=gen, requires_grad=True)
        keep = torch.ones(2, 6)
        keep[1, -2:] = 0
        mask = (1.0 - keep)[:, None, None, :] * torch.finfo(torch.float32).min
        out, out_mask = smp((x, mask))
        assert out_mask is mask
        xr = x.detach().clone().requires_grad_(True)
        ref = xr
        for layer in ref_layers:
            ref = _first(layer(ref, attention_mask=mask))
        assert_close(f"DistributedTransformer vs BertLayer prescaled={prescaled}", out, ref)
        w = torch.randn(out.shape, generator=gen)  # (a squared LN output would have a ~zero gradient)
        (out * w).sum().backward()
        (ref * w).sum().backward()
        assert_close("DistributedTransformer input grad", x.grad, xr.grad)
        gathered = gather_full_state_dict(smp, ctx)
        for k, v in full.items():
            assert_close(f"gathered {k}", gathered[k], v)

        # one pre-LN causal GPT-2 block == DistributedTransformerLayer(pre_layernorm, causal)
        torch.manual_seed(1)
        gcfg = tf.GPT2Config(n_embd=32, n_head=4, n_positions=16, activation_function="gelu", resid_pdrop=0.0,
                             attn_pdrop=0.0, embd_pdrop=0.0, layer_norm_epsilon=1e-5)
        gcfg._attn_implementation = "sdpa"  # causal without a mask (eager needs the model's mask)
        block = GPT2Block(gcfg, layer_idx=0).eval()
        layer = DistributedTransformerLayer(num_attention_heads=4, attention_head_size=8, hidden_size=32,
                                            intermediate_size=128, attention_dropout_prob=0.0,
                                            hidden_dropout_prob=0.0, causal_mask_size=16, pre_layernorm=True,
                                            post_layernorm=False).eval()
        layer.load_state_dict(shard_state_dict(layer, _gpt2_block_to_smp(block.state_dict(), 32), ctx), strict=True)
        h = torch.randn(2, 7, 32, generator=gen)
        assert_close(f"DistributedTransformerLayer vs GPT2Block prescaled={prescaled}",
                      layer((h, None))[0], _first(block(h)))
    set_current_tp_context(None)
    return True


def test_smp_transformer_layers_tp2():
    assert run_distributed(_smp_transformer_body, 2) == [True, True]


# ---------------------------------------------------------------- DistributedTransformerLMHead


def _lm_head_body(rank, world):
    import torch.distributed as dist

    from smp_adapter.parallel.nn import DistributedTransformerLMHead
    from smp_adapter.parallel.tensor import TPContext, gather_full_state_dict, set_current_tp_context

    kw = dict(num_layers=2, num_attention_heads=2, attention_head_size=8, hidden_size=16, intermediate_size=32,
              vocab_size=32, num_positions=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
              causal_mask_size=16, pre_layernorm=True, post_layernorm=True)
    alone = [dist.new_group([r]) for r in range(world)]  # every rank joins every new_group call
    for prescaled in (False, True):
        set_current_tp_context(TPContext(dist.group.WORLD, rank, world, prescaled))
        # seeded alike: replicated parameters (position embedding, LayerNorms) must be equal on the TP
        # ranks, as DistributedModel makes them; the shards are then slices of one full model
        torch.manual_seed(11)
        lm = DistributedTransformerLMHead(**kw)
        assert lm.lm_head.weight is lm.word_embedding.weight and tuple(lm.word_embedding.weight.shape) == (16, 16)
        full = gather_full_state_dict(lm, lm.tp_context)
        set_current_tp_context(TPContext(alone[rank], 0, 1, False))
        ref = DistributedTransformerLMHead(**kw)
        ref.load_state_dict(full)
        gen = torch.Generator().manual_seed(0 if prescaled else rank)
        ids = torch.randint(0, 32, (2, 6), generator=gen)
        mask = torch.zeros(2, 6)
        mask[1, 4:] = 1  # smp convention: 1 = masked
        set_current_tp_context(TPContext(dist.group.WORLD, rank, world, prescaled))
        loss, logits = lm((ids, mask, None, None, ids))
        ref_loss, ref_logits = ref((ids, mask, None, None, ids))
        assert_close(f"LM head logits prescaled={prescaled}", logits, ref_logits)
        assert_close(f"LM head loss prescaled={prescaled}", loss, ref_loss)
        changed = ids.clone()
        changed[1, 5] = (ids[1, 5] + 1) % 32  # a masked position: unmasked outputs must not move
        assert_close("masked position ignored", lm((changed, mask, None, None, None))[1, :4], logits[1, :4])
    set_current_tp_context(None)
    return True


def test_distributed_transformer_lm_head_tp2_matches_unsplit():
    assert run_distributed(_lm_head_body, 2) == [True, True]
