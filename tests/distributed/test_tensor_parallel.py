"""Tensor parallelism (smp_adapter.parallel) against the unsplit model, on CPU/gloo.

Every rank builds the full model with the same seed, keeps an unsplit copy as the reference, then
splits with ``apply_tensor_parallelism``. Checked, for ``prescaled_batch`` False (rank r feeds its own
batch; compared with the unsplit model on that batch) and True (the TP group shares one batch):

* outputs within 1e-5 relative (fp32) of the unsplit model;
* every split parameter holds 1/tp of the original tensor;
* gradients, gathered to the original layout, equal the reference gradients: for split parameters
  without prescaling the gradient of the *mean of the TP group's losses* (the batch was gathered),
  otherwise of the rank's own loss;
* a few SGD steps, with gradients reduced the way the runtime does (``tp_gradient_sync`` then an
  average over the RDP group, i.e. split parameters averaged over RDP, the others over DP), give
  the unsplit model's losses and weights on the global batch;
* ``gather_full_state_dict`` loads strictly into a fresh unsplit model with the same outputs.

smp.nn modules built directly (DistributedLinear/Embedding, the transformer layers) are in
test_tp_smp_nn.py.
"""

from __future__ import annotations

import pytest
import torch

from spawn import run_distributed
from tp_asserts import RTOL, assert_close, hf_quiet

pytestmark = pytest.mark.distributed



def _full_grads(model, ctx):
    """name -> (gradient in the original layout, is split); collective over the TP group."""
    import torch.distributed as dist

    from smp_adapter.parallel.tensor import is_distributed_parameter

    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        layout = getattr(p, "_smp_tp_layout", None)
        if layout is not None:
            parts = [torch.empty_like(g) for _ in range(ctx.size)]
            dist.all_gather(parts, g.contiguous(), group=ctx.group)
            g = layout.unshard(parts)
        out[name] = (g, is_distributed_parameter(p))
    return out


def _groups(world, tp):
    """TP groups of consecutive ranks (tp fastest, as smp's default placement) and RDP groups."""
    import torch.distributed as dist

    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    rdp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tp_groups, rdp_groups


def check_model(rank, world, tp, prescaled, make_model, make_batch, loss_fn, steps=0, lr=0.1, label=""):
    """Run every check for one model. ``make_batch(i)`` gives sample set i (deterministic);
    ``loss_fn(model, batch) -> (loss, output)``."""
    import torch.distributed as dist

    from smp_adapter.parallel.tensor import (TPContext, apply_tensor_parallelism, gather_full_state_dict,
                                             tp_gradient_sync)

    tp_groups, rdp_groups = _groups(world, tp)
    g, tp_rank = rank // tp, rank % tp
    ctx = TPContext(tp_groups[g], tp_rank, tp, prescaled)
    rdp_group, rdp = rdp_groups[tp_rank], world // tp

    torch.manual_seed(1234)
    model = make_model(True)
    ref = make_model(False)
    ref.load_state_dict(model.state_dict())
    model.eval(), ref.eval()
    names = apply_tensor_parallelism(model, ctx)
    assert names, f"{label}: nothing was distributed"

    # 1/tp of every split parameter
    split = [(n, p) for n, p in model.named_parameters() if getattr(p, "_smp_tp_layout", None) is not None]
    assert split, f"{label}: no split parameters"
    for n, p in split:
        full = torch.Size(p._smp_tp_layout.full_shape)
        assert p.numel() * tp == full.numel(), f"{label}: {n} holds {p.numel()} of {full.numel()} elements"

    # batches: without prescaling every rank has its own; prescaled: one per TP group
    def batch_id(r, step=0):
        return 1000 * step + (r // tp if prescaled else r)

    group_ranks = range(g * tp, (g + 1) * tp)
    batch = make_batch(batch_id(rank))
    loss, out = loss_fn(model, batch)
    ref_loss, ref_out = loss_fn(ref, batch)
    assert_close(f"{label} output", out.detach(), ref_out.detach())
    assert_close(f"{label} loss", loss.detach(), ref_loss.detach())

    # gradients
    loss.backward()
    ref_loss.backward()
    own = {n: p.grad.clone() for n, p in ref.named_parameters()}
    if prescaled:
        group_mean = own
    else:  # a split parameter sees the whole TP group's samples: its gradient averages their losses
        ref.zero_grad()
        (sum(loss_fn(ref, make_batch(batch_id(r)))[0] for r in group_ranks) / tp).backward()
        group_mean = {n: p.grad.clone() for n, p in ref.named_parameters()}
    grads = _full_grads(model, ctx)
    assert set(grads) == set(own), f"{label}: parameter names differ: {set(grads) ^ set(own)}"
    for n, (gfull, is_split) in grads.items():
        assert_close(f"{label} grad {n}", gfull, group_mean[n] if is_split else own[n], atol=1e-7)

    # unsplit state dict -> fresh unsplit model
    full_sd = gather_full_state_dict(model, ctx)
    fresh = make_model(False)
    fresh.load_state_dict(full_sd, strict=True)
    fresh.eval()
    assert_close(f"{label} reloaded output", loss_fn(fresh, batch)[1].detach(), ref_out.detach())

    # SGD steps with the runtime's reduction; reference: unsplit model on the global batch
    losses, ref_losses = [], []
    for step in range(1, steps + 1):
        model.zero_grad()
        loss, _ = loss_fn(model, make_batch(batch_id(rank, step)))
        loss.backward()
        tp_gradient_sync(model.parameters(), ctx)
        for p in model.parameters():
            if rdp > 1:
                dist.all_reduce(p.grad, group=rdp_group)
                p.grad.div_(rdp)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
        losses.append(loss.item())

        ref.zero_grad()
        ids = sorted({batch_id(r, step) for r in range(world)})
        per = [loss_fn(ref, make_batch(i))[0] for i in ids]
        ref_losses.append(per[ids.index(batch_id(rank, step))].item())
        (sum(per) / len(per)).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.sub_(lr * p.grad)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= RTOL * max(abs(b), 1e-6), f"{label}: step {i + 1} loss {a} != reference {b}"
    if steps:
        full_sd = gather_full_state_dict(model, ctx)
        for k, v in ref.state_dict().items():
            assert_close(f"{label} trained {k}", full_sd[k], v, rtol=1e-4)
    return names


# ---------------------------------------------------------------- the seed's conv net


def _created(build, marked: bool):
    """The model ``build()`` makes, created inside smp.tensor_parallelism() when ``marked`` (the
    distributed run) and plainly for the single-process reference."""
    from smp_adapter.parallel.marking import tensor_parallelism

    if marked:
        with tensor_parallelism():
            return build()
    return build()


def _seed_net(marked: bool):
    import torch.nn as nn
    import torch.nn.functional as F

    class Net(nn.Module):  # the seed script's Net at 12x12 input: fc1 = Linear(128, 32)
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3, 1)
            self.conv2 = nn.Conv2d(4, 8, 3, 1)
            self.fc1 = nn.Linear(128, 32)
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x):
            x = F.relu(self.conv2(F.relu(self.conv1(x))))
            x = torch.flatten(F.max_pool2d(x, 2), 1)
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), 1)

    return _created(Net, marked)


def _seed_batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(4, 1, 12, 12, generator=gen), torch.randint(0, 10, (4,), generator=gen)


def _seed_loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    out = model(x)
    return F.nll_loss(out, y), out


def _seed_net_body(rank, world):
    from smp_adapter.parallel.nn import DistributedLinear

    results = {}
    for tp in (2, 4):
        for prescaled in (False, True):
            names = check_model(rank, world, tp, prescaled, _seed_net, _seed_batch, _seed_loss, steps=3,
                                label=f"seed net tp={tp} prescaled={prescaled}")
            results[(tp, prescaled)] = names
    # the marked linears became smp.nn.DistributedLinear with the input dimension split
    from smp_adapter.parallel.tensor import TPContext, apply_tensor_parallelism
    import torch.distributed as dist

    net = _seed_net(True)
    apply_tensor_parallelism(net, TPContext(dist.group.WORLD, rank, world, False))
    assert isinstance(net.fc1, DistributedLinear) and tuple(net.fc1.weight.shape) == (32, 128 // world)
    assert tuple(net.fc2.weight.shape) == (10, 32 // world) and tuple(net.fc2.bias.shape) == (10,)
    return results


def test_seed_net_tp2_tp4():
    results = run_distributed(_seed_net_body, 4)
    for res in results:
        for key, names in res.items():
            assert names == ["fc1", "fc2"], (key, names)


# ---------------------------------------------------------------- Hugging Face models


def _causal_lm(family):
    def make(marked):
        import transformers as tf

        hf_quiet()
        common = dict(vocab_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if family == "gpt2":
            cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0, **common)
            cls = tf.GPT2LMHeadModel
        elif family in ("llama", "mistral", "qwen2"):
            cfg_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
            cfg = cfg_cls(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=(family == "qwen2"),
                          **common)
            cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM}[family]
        elif family == "gpt_neox":
            cfg = tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, **common)
            cls = tf.GPTNeoXForCausalLM
        elif family == "gptneo":
            cfg = tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=64,
                                  attention_types=[[["global", "local"], 1]], window_size=4, resid_dropout=0.0,
                                  embed_dropout=0.0, attention_dropout=0.0, **common)
            cls = tf.GPTNeoForCausalLM
        elif family == "gptj":
            cfg = tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, **common)
            cls = tf.GPTJForCausalLM
        else:
            raise ValueError(family)
        return _created(lambda: cls(cfg), marked)

    return make


def _lm_batch(i):
    gen = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 128, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one sample: the mask must travel with its sample
    return ids, mask


def _lm_loss(model, batch):
    ids, mask = batch
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    return out.loss, out.logits


def _gpt2_llama_body(rank, world):
    import torch.distributed as dist

    from smp_adapter.parallel.tensor import TPContext, apply_tensor_parallelism

    # attention head counts are divided, fused q|k|v sliced per part, the LM head stays tied
    model = _causal_lm("gpt2")(True)
    apply_tensor_parallelism(model, TPContext(dist.group.WORLD, rank, world, False))
    attn = model.transformer.h[0].attn
    assert (attn.num_heads, attn.split_size) == (4 // world, 32 // world)
    assert tuple(attn.c_attn.weight.shape) == (3 * 32 // world, 32)  # Megatron's [out, in] layout
    assert model.lm_head.weight is model.transformer.wte.weight
    assert tuple(model.lm_head.weight.shape) == (128 // world, 32)

    found = {}
    for family in ("gpt2", "llama"):
        for prescaled in (False, True):
            found[(family, prescaled)] = check_model(rank, world, 2, prescaled, _causal_lm(family), _lm_batch,
                                                     _lm_loss, steps=2, label=f"{family} prescaled={prescaled}")
    return found


def test_gpt2_and_llama_tp2():
    res = run_distributed(_gpt2_llama_body, 2)[0]
    gpt2 = res[("gpt2", False)]
    assert {"transformer.wte", "lm_head", "transformer.h.0.attn", "transformer.h.0.mlp",
            "transformer.h.1.attn", "transformer.h.1.mlp"} <= set(gpt2)
    llama = res[("llama", False)]
    assert {"model.embed_tokens", "lm_head", "model.layers.0.self_attn", "model.layers.0.mlp",
            "model.layers.1.self_attn", "model.layers.1.mlp"} <= set(llama)


def _encoder(family):
    def make(marked):
        import transformers as tf

        hf_quiet()
        if family in ("bert", "roberta"):
            cfg_cls = tf.BertConfig if family == "bert" else tf.RobertaConfig
            cfg = cfg_cls(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, num_labels=4, type_vocab_size=2, pad_token_id=1)
            cls = tf.BertForSequenceClassification if family == "bert" else tf.RobertaForSequenceClassification
        elif family == "vit":
            cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
            cls = tf.ViTForImageClassification
        elif family == "t5":
            cfg = tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                              dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                              feed_forward_proj="gated-gelu")
            cls = tf.T5ForConditionalGeneration
        else:
            raise ValueError(family)
        return _created(lambda: cls(cfg), marked)

    return make


def _cls_batch(i):
    gen = torch.Generator().manual_seed(i)
    ids = torch.randint(2, 128, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    return ids, mask, torch.randint(0, 4, (2,), generator=gen)


def _cls_loss(model, batch):
    ids, mask, y = batch
    out = model(input_ids=ids, attention_mask=mask, labels=y)
    return out.loss, out.logits


def _vit_batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(2, 3, 16, 16, generator=gen), torch.randint(0, 4, (2,), generator=gen)


def _vit_loss(model, batch):
    x, y = batch
    out = model(pixel_values=x, labels=y)
    return out.loss, out.logits


def _t5_batch(i):
    gen = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 128, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return ids, mask, torch.randint(1, 128, (2, 6), generator=gen)


def _t5_loss(model, batch):
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    return out.loss, out.logits


OTHER_FAMILIES = {
    "mistral": (_causal_lm("mistral"), _lm_batch, _lm_loss),
    "qwen2": (_causal_lm("qwen2"), _lm_batch, _lm_loss),  # tied embeddings
    "gpt_neox": (_causal_lm("gpt_neox"), _lm_batch, _lm_loss),
    "gptj": (_causal_lm("gptj"), _lm_batch, _lm_loss),
    "gptneo": (_causal_lm("gptneo"), _lm_batch, _lm_loss),  # local attention layer too
    "bert": (_encoder("bert"), _cls_batch, _cls_loss),
    "roberta": (_encoder("roberta"), _cls_batch, _cls_loss),
    "vit": (_encoder("vit"), _vit_batch, _vit_loss),
    "t5": (_encoder("t5"), _t5_batch, _t5_loss),
}


def _other_families_body(rank, world):
    found = {}
    for family, (make, batch, loss) in OTHER_FAMILIES.items():
        for prescaled in (False, True):
            found[(family, prescaled)] = check_model(rank, world, 2, prescaled, make, batch, loss,
                                                     label=f"{family} prescaled={prescaled}")
    return found


def test_other_hf_families_tp2():
    import transformers

    res = run_distributed(_other_families_body, 2)[0]
    # module names that differ between releases (the modules themselves do): GPT-NeoX's LM head is
    # embed_out before 5.0; ViT's layers are vit.encoder.layer.N with BERT's layout before 5.0; T5's
    # encoder/decoder embed_tokens are the `shared` module itself before 5.0 (one name), tied copies after
    tf4 = int(transformers.__version__.split(".")[0]) < 5
    expect = {
        "mistral": ["model.embed_tokens", "lm_head", "model.layers.1.self_attn", "model.layers.1.mlp"],
        "qwen2": ["model.embed_tokens", "lm_head", "model.layers.0.self_attn"],  # tied: one shard
        "gpt_neox": ["gpt_neox.embed_in", "embed_out" if tf4 else "lm_head", "gpt_neox.layers.0.attention",
                     "gpt_neox.layers.0.mlp"],
        "gptj": ["transformer.wte", "lm_head", "transformer.h.0.attn", "transformer.h.0.mlp"],
        "gptneo": ["transformer.wte", "lm_head", "transformer.h.0.attn.attention", "transformer.h.1.mlp"],
        "bert": ["bert.embeddings.word_embeddings", "bert.encoder.layer.0.attention", "bert.encoder.layer.0"],
        "roberta": ["roberta.embeddings.word_embeddings", "roberta.encoder.layer.1.attention", "roberta.encoder.layer.1"],
        "vit": (["vit.encoder.layer.0.attention", "vit.encoder.layer.0", "vit.encoder.layer.1"] if tf4 else
                ["vit.layers.0.attention", "vit.layers.0.mlp", "vit.layers.1.mlp"]),
        "t5": ["shared", *([] if tf4 else ["encoder.embed_tokens", "decoder.embed_tokens"]), "lm_head",
               "encoder.block.0.layer.0.SelfAttention", "decoder.block.1.layer.1.EncDecAttention",
               "decoder.block.1.layer.2.DenseReluDense"],
    }
    for family, wanted in expect.items():
        names = res[(family, False)]
        missing = [n for n in wanted if n not in names]
        assert not missing, (family, missing, names)
