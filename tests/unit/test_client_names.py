"""The smp names the public AWS scripts import (issue 12, item 1), each against an independent
reference: LayerNorm, attention written out with matmul/softmax, LAMB and NovoGrad updates
computed by hand from apex's formulas."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from smp_adapter.errors import SMPCheckpointError, UnsupportedFeatureError
from smp_adapter.check.script import check_source

# every import line of the clients (see the README's "public AWS examples" table)
CLIENT_IMPORTS = """
import smdistributed.modelparallel
import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.nn import FusedLayerNorm as LayerNorm
from smdistributed.modelparallel.torch.nn import FlashAttentionLayer
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
from smdistributed.modelparallel.torch.optimizers import FusedLAMB
from smdistributed.modelparallel.torch.utils import rmsg
from smdistributed.modelparallel.torch.utils import get_distribution_axis
from smdistributed.modelparallel.torch.state_mod import state as smp_state
from smdistributed.modelparallel.test.torch.utils import dump_model, verify
"""


def test_every_client_import_resolves_and_check_calls_it_supported():
    exec(compile(CLIENT_IMPORTS, "client.py", "exec"), {})
    report = check_source(CLIENT_IMPORTS, "client.py")
    imports = [u for u in report.uses if u.kind == "import"]
    assert len(imports) == 11, imports  # every `from smdistributed... import X` line, the two test helpers apart
    assert {u.status for u in imports} == {"supported"}, [u for u in imports if u.status != "supported"]


def test_fused_layer_norm_is_layer_norm():
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    fused, plain = FusedLayerNorm(8, eps=1e-12), torch.nn.LayerNorm(8, eps=1e-12)
    torch.testing.assert_close(fused(x), plain(x))
    # scripts keep norms out of weight decay with isinstance(m, FusedLayerNorm)
    assert isinstance(plain, FusedLayerNorm) and isinstance(fused, torch.nn.LayerNorm)
    assert not isinstance(torch.nn.Linear(2, 2), FusedLayerNorm)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_layer_matches_written_out_attention(causal):
    from smdistributed.modelparallel.torch.nn import FlashAttentionLayer

    torch.manual_seed(1)
    qkv = torch.randn(2, 5, 3, 4, 8)  # [B, S, 3, H, D]
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, ..., 3:] = -1e9  # batch 1 cannot attend to its last two positions
    layer = FlashAttentionLayer(attention_dropout_prob=0.0, scale_attn_by_layer_idx=True, layer_idx=2).eval()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    scores = q @ k.transpose(-1, -2) / (math.sqrt(8) * 3) + mask
    if causal:
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(layer(qkv, attn_mask=mask, causal=causal), expected, rtol=1e-5, atol=1e-6)


def test_flash_attention_layer_refuses_alibi_and_bad_shapes():
    from smdistributed.modelparallel.torch.nn import FlashAttentionLayer

    with pytest.raises(UnsupportedFeatureError, match=r"use_alibi=True\) needs smp's Triton kernel.*BLOOM, MPT"):
        FlashAttentionLayer(use_alibi=True)
    with pytest.raises(Exception, match=r"expects qkv of shape \[batch, seq, 3, heads, head_dim\], got \(2, 5, 8\)"):
        FlashAttentionLayer()(torch.zeros(2, 5, 8))


def _lamb_by_hand(w, g, m, v, t, lr, b1, b2, eps, wd, clip):
    g = g / clip
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
    return w - lr * (w.norm() / u.norm()) * u, m, v


def test_fused_lamb_matches_apex_formula_with_global_clipping():
    from smdistributed.modelparallel.torch.optimizers import FusedLAMB, FusedLamb

    assert FusedLamb is FusedLAMB
    torch.manual_seed(2)
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    opt = FusedLAMB([a, b], lr=0.1, weight_decay=0.01, max_grad_norm=1.0)
    wa, wb = a.detach().clone(), b.detach().clone()
    ma, va, mb, vb = (torch.zeros_like(wa), torch.zeros_like(wa), torch.zeros_like(wb), torch.zeros_like(wb))
    for t in (1, 2):
        ga, gb = torch.randn(4, 3) * 3, torch.randn(3) * 3  # global norm > 1: clipping is active
        a.grad, b.grad = ga.clone(), gb.clone()
        opt.step()
        clip = max(1.0, torch.cat([ga.flatten(), gb]).norm().item())
        wa, ma, va = _lamb_by_hand(wa, ga, ma, va, t, 0.1, 0.9, 0.999, 1e-6, 0.01, clip)
        wb, mb, vb = _lamb_by_hand(wb, gb, mb, vb, t, 0.1, 0.9, 0.999, 1e-6, 0.01, clip)
        torch.testing.assert_close(a.detach(), wa)
        torch.testing.assert_close(b.detach(), wb)


def test_fused_novograd_matches_apex_formula():
    from smdistributed.modelparallel.torch.optimizers import FusedNovoGrad

    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedNovoGrad([p], lr=0.05, betas=(0.95, 0.98), weight_decay=0.001)
    w, m, v = p.detach().clone(), torch.zeros(5), None
    for t in (1, 2, 3):
        g = torch.randn(5)
        p.grad = g.clone()
        opt.step()
        n = g.pow(2).sum()
        v = n if v is None else 0.98 * v + 0.02 * n
        m = 0.95 * m + 0.05 * g / ((v / (1 - 0.98 ** t)).sqrt() + 1e-8)
        w = w - 0.05 * (m / (1 - 0.95 ** t) + 0.001 * w)
        torch.testing.assert_close(p.detach(), w)


def test_fused_adam_l2_mode_is_torch_adam():
    from smdistributed.modelparallel.torch.optimizers import FusedAdam

    p = torch.nn.Parameter(torch.ones(2))
    assert type(FusedAdam([p], adam_w_mode=False, weight_decay=0.1)) is torch.optim.Adam
    with pytest.raises(UnsupportedFeatureError, match=r"bias_correction=False\) is not supported.*remove the argument"):
        FusedAdam([p], bias_correction=False)


def test_utils_state_mod_and_distribution_axis():
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.state_mod import state
    from smdistributed.modelparallel.torch.utils import get_distribution_axis, rmsg
    from smp_adapter.parallel.layers import ShardLayout, LAYOUT_ATTR

    assert state is smp.state and rmsg("hello") == f"[{state.rank}] hello"
    column, gpt2_conv, plain = torch.nn.Parameter(torch.ones(2, 8)), torch.nn.Parameter(torch.ones(2, 8)), torch.ones(3)
    setattr(column, LAYOUT_ATTR, ShardLayout((4, 8), 0))  # nn.Linear weight [out, in], output features split
    setattr(gpt2_conv, LAYOUT_ATTR, ShardLayout((8, 4), 1, 3, transposed=True))  # Conv1D [in, out] stored [out/tp, in]
    assert (get_distribution_axis(column), get_distribution_axis(gpt2_conv), get_distribution_axis(plain)) == (0, 0, None)


def test_dump_model_and_verify(tmp_path, monkeypatch):
    from smdistributed.modelparallel.test.torch.utils import dump_model, verify

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(3, 2)
    out = model(torch.ones(1, 3))
    out.sum().backward()
    dump_model(model, 7, "ref", out, out.sum())
    verify(model, 7, "ref", out, out.sum())
    with torch.no_grad():
        model.bias.add_(1.0)
    with pytest.raises(AssertionError, match="params bias"):
        verify(model, 7, "ref", out, out.sum())


def test_translate_function_names_and_family_checks():
    gpt2 = importlib.import_module("smdistributed.modelparallel.torch.nn.huggingface.gpt2")
    t5 = importlib.import_module("smdistributed.modelparallel.torch.nn.huggingface.t5")
    sd = {"transformer.h.0.attn.c_attn.weight": torch.ones(2, 6), "transformer.wpe.weight": torch.ones(16, 2)}
    assert gpt2.translate_hf_state_dict_to_smdistributed(sd, 16).keys() == sd.keys()  # the DLC script's call
    with pytest.raises(SMPCheckpointError, match="max_seq_len=32 exceeds the model's 16 positions"):
        gpt2.translate_hf_state_dict_to_smdistributed(sd, 32)
    with pytest.raises(SMPCheckpointError, match=r"does not look like a t5 state dict.*SelfAttention.q.weight"):
        t5.translate_state_dict_to_hf_t5(sd)


def test_huggingface_families_are_attributes_without_an_import():
    """The templates call smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2(...) after importing
    only smdistributed.modelparallel.torch, as smp v1 allowed."""
    import smdistributed.modelparallel.torch as smp

    assert callable(smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2)
    assert callable(smp.nn.huggingface.t5.translate_state_dict_to_hf_t5)
    with pytest.raises(AttributeError, match="smp.nn.huggingface has no family 'bloom': one of bert, gpt2"):
        smp.nn.huggingface.bloom
