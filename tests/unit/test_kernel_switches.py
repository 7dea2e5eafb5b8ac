"""smp v1's kernel switches (translate/kernels.py says what each becomes; runtime/kernel_switches.py,
runtime/attention.py and compat/fused_optimizers.py do it): what each changes, checked on CPU, and that the
numbers stay those of the unswitched run within the dtype's rounding. The CUDA kernels themselves are
exercised by benchmarks/gpu_throughput.py on a GPU.

torch.compile here uses the aot_eager backend: it traces and partitions the graph as inductor does
(dynamo, AOTAutograd) but runs the aten ops eagerly, in about 1 s on one CPU core; inductor's C++
code generation takes ~25 s for two tiny blocks, too slow for the unit tier."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smdistributed.modelparallel.torch as smp
from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPConfigError, UnsupportedFeatureError
from smp_adapter.compat.fused_optimizers import fused_supported, prefer_fused
from smp_adapter.runtime import attention
from smp_adapter.runtime.init import shutdown
from smp_adapter.translate.kernels import (COMPILE_ENV, SWITCHES, CompileSetting, compile_refusal,
                                           compile_setting_from, explain_rows)


# -- attention: the backend that ran is recorded -------------------------------------------------------
def test_attention_recorder_names_the_kernel_that_ran_not_the_one_asked_for(fresh, capsys):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    smp.init({})
    assert attention.attention_backends() == {}
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.0)
    qkv = torch.randn(2, 16, 3, 4, 8)
    flash = layer(qkv, causal=True)
    with sdpa_kernel([SDPBackend.MATH]):  # torch told to run math: the record must say so
        math = layer(qkv, attn_mask=torch.ones(16, 16, dtype=torch.bool))
        layer(qkv, attn_mask=torch.ones(16, 16, dtype=torch.bool))  # the same kind again: said once
    assert attention.attention_backends() == {("cpu", "float32", "causal", False): "flash (CPU)",
                                            ("cpu", "float32", "mask", False): "math"}
    said = [line for line in capsys.readouterr().err.splitlines() if "attention (" in line]
    assert said == ["smp-adapter: attention (cpu float32, causal) ran on SDPA's flash (CPU) kernel",
                    "smp-adapter: attention (cpu float32, mask) ran on SDPA's math kernel"]
    # recording does not change the numbers: torch's own function, same kernel, bit for bit
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    torch_sdpa = F.scaled_dot_product_attention.__wrapped__
    assert torch.equal(flash, torch_sdpa(q, k, v, is_causal=True, scale=8 ** -0.5))
    # flash and math compute one attention: equal within float32 rounding of a 16-term softmax sum
    # (different summation order; 1e-6 is ~10 float32 ulps at these magnitudes)
    with sdpa_kernel([SDPBackend.MATH]):
        assert torch.allclose(layer(qkv, causal=True), flash, rtol=1e-5, atol=1e-6)
    assert math.shape == flash.shape
    shutdown()
    assert attention.attention_backends() == {}  # one job's record


def test_backend_names_from_aten_kernels():
    assert attention.backend_of(["aten._scaled_dot_product_flash_attention.default"]) == "flash"
    assert attention.backend_of(["aten._scaled_dot_product_efficient_attention.default"]) == "efficient"
    assert attention.backend_of(["aten._scaled_dot_product_cudnn_attention.default"]) == "cudnn"
    assert attention.backend_of(["aten.bmm.default", "aten._safe_softmax.default"]) == "math"


def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=64, max_position_embeddings=32, use_cache=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("keyword", ["flash_attention", "fused_softmax", None])
def test_flash_attention_switches_eager_hugging_face_attention_to_sdpa(fresh, keyword):
    """model_creation(flash_attention=True), or fused_softmax=True (torch fuses the softmax only in
    SDPA): a model built with eager attention runs SDPA after DistributedModel; its logits are the eager model's within float32 rounding (1e-5: the fused
    kernel sums the softmax in another order). Not asked: the model keeps eager attention."""
    smp.init({})
    reference = _tiny_llama("eager")
    asked = keyword is not None
    with smp.model_creation(**({keyword: True} if asked else {"flash_attention": False})):
        model = _tiny_llama("eager")
    model = smp.DistributedModel(model)
    inner = model.get_module()
    x = torch.randint(0, 64, (2, 12))
    assert inner.config._attn_implementation == ("sdpa" if asked else "eager")
    with torch.no_grad():
        logits = model(input_ids=x).logits
        expected = reference(input_ids=x).logits  # eager attention: SDPA is not called
    recorded = attention.attention_backends()
    # transformers 5 passes is_causal to SDPA; 4.x (the matrix's 4.38) passes its causal mask instead
    kinds = {("cpu", "float32", "causal", False), ("cpu", "float32", "mask", False)}
    if asked:
        assert len(recorded) == 1 and set(recorded) <= kinds, recorded
        assert list(recorded.values()) == ["flash (CPU)"], recorded
    else:
        assert recorded == {}
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-5)


# -- FusedLayerNorm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_layer_norm_is_torchs_single_kernel(dtype, tol):
    """smp.nn.FusedLayerNorm runs torch's one layer_norm kernel (a fused CUDA kernel on a GPU), not a
    composition of ops, and computes LayerNorm: against the float32 formula within float32 rounding
    (1e-5: a 64-term mean and variance) or, in bfloat16, within 2e-2 (8 significant bits: input, weight
    and output each rounded to ~2^-9 relative, on values up to ~4)."""
    torch.manual_seed(0)
    norm = smp.nn.FusedLayerNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 5, 64, dtype=dtype)
    mode = attention.op_names_mode()
    with mode:
        out = norm(x)
    assert [n for n in mode.names if "norm" in n] == ["native_layer_norm.default"], mode.names
    xf = x.float()
    ref = (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
    ref = ref * norm.weight.float() + norm.bias.float()
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


# -- optimizers ---------------------------------------------------------------------------------------
def _params():
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(5))]


def _train(optimizer, params, steps=5):
    for i in range(steps):
        torch.manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_prefer_fused_switches_adam_and_trains_the_same_numbers(cls):
    """The switch on CUDA (device_types=("cuda",)); here pointed at the CPU, where torch has a fused
    Adam kernel too, to show what it changes: every group fused, the same update as torch's default
    within float32 rounding (5 steps, lr 1e-2: the kernels divide and take square roots in another
    order; 1e-6 absolute is a few ulps of weights ~1)."""
    plain_params, fused_params = _params(), _params()
    plain = cls(plain_params, lr=1e-2, weight_decay=0.1)
    fused = cls(fused_params, lr=1e-2, weight_decay=0.1)
    assert prefer_fused(fused, device_types=("cpu",)) is True
    assert [g["fused"] for g in fused.param_groups] == [True] and fused.defaults["fused"] is True
    calls = []
    real = torch._fused_adamw_ if cls is torch.optim.AdamW else torch._fused_adam_
    name = real.__name__ if hasattr(real, "__name__") else ("_fused_adamw_" if cls is torch.optim.AdamW else "_fused_adam_")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        got = _train(fused, fused_params)
    assert calls, "the fused kernel did not run"
    for a, b in zip(got, _train(plain, plain_params)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert torch.equal(fused.state[fused_params[0]]["step"], torch.tensor(5.0))


def test_prefer_fused_keeps_what_the_script_chose_and_the_cpu_default():
    assert prefer_fused(torch.optim.AdamW(_params())) is False  # CPU parameters: torch's default kept
    assert prefer_fused(torch.optim.AdamW(_params(), foreach=False), device_types=("cpu",)) is False
    assert prefer_fused(torch.optim.AdamW(_params(), fused=False), device_types=("cpu",)) is False
    assert prefer_fused(torch.optim.SGD(_params(), lr=0.1), device_types=("cpu",)) is False
    stepped = torch.optim.AdamW(_params())
    _train(stepped, stepped.param_groups[0]["params"], steps=1)
    assert prefer_fused(stepped, device_types=("cpu",)) is False  # state exists: too late to switch
    assert fused_supported([torch.zeros(2, dtype=torch.int64)], ("cpu",)) is False


def test_distributed_optimizer_and_fused_adam_on_cpu_keep_torchs_default(fresh):
    smp.init({})
    model = smp.DistributedModel(nn.Linear(4, 3))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    assert optimizer.param_groups[0]["fused"] is None  # CPU: left as the script built it
    fused_adam = smp.optimizers.FusedAdam(_params())
    assert fused_adam.param_groups[0]["fused"] is None and isinstance(fused_adam, torch.optim.AdamW)


def test_grad_scaler_unscales_before_a_fused_step_through_distributed_optimizer(fresh):
    """A fused torch optimizer tells GradScaler it unscales inside its kernel; given smp's wrapper,
    the scale would be set on the wrapper and the kernel would step on scaled gradients. The wrapper
    says no, so GradScaler unscales first: the same weights as an unscaled AdamW (exactly: the scale
    is a power of two). eps=1 makes Adam's update depend on the gradient's scale."""
    smp.init({})
    torch.manual_seed(0)
    reference, module = nn.Linear(4, 3), nn.Linear(4, 3)
    module.load_state_dict(reference.state_dict())
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, eps=1.0, fused=True))
    plain = torch.optim.AdamW(reference.parameters(), lr=0.1, eps=1.0)
    scaler = smp.amp.GradScaler(init_scale=1024.0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    F.cross_entropy(reference(x), y).backward()
    plain.step()
    assert torch.equal(model.get_module().weight, reference.weight)


# -- compile per block ----------------------------------------------------------------------------------
def test_compile_setting_values():
    assert compile_setting_from({}) == CompileSetting("off")
    assert compile_setting_from({COMPILE_ENV: "blocks"}) == CompileSetting("blocks", "inductor")
    assert compile_setting_from({COMPILE_ENV: " Blocks:aot_eager "}) == CompileSetting("blocks", "aot_eager")
    assert str(compile_setting_from({COMPILE_ENV: "blocks:aot_eager"})) == "blocks:aot_eager"
    for bad in ("on", "off:inductor", "blocks:", "1"):
        with pytest.raises(SMPConfigError, match=COMPILE_ENV):
            compile_setting_from({COMPILE_ENV: bad})


def _dims(options, world):
    return ParallelDims.from_config(SMPConfig.from_sources(options, {}), world)


def test_compile_refused_by_name_where_it_cannot_run_and_explain_says_so():
    assert compile_refusal(_dims({"ddp": True}, 4)) is None
    assert compile_refusal(_dims({"ddp": True, "shard_optimizer_state": True}, 4)) is None
    assert compile_refusal(_dims({"ddp": True, "sharded_data_parallel_degree": 2}, 4)) is None  # MiCS
    assert "pipeline_parallel_degree 2" in compile_refusal(_dims({"pipeline_parallel_degree": 2}, 2))
    assert "tensor_parallel_degree 2" in compile_refusal(_dims({"tensor_parallel_degree": 2, "ddp": True}, 2))
    zero3 = compile_refusal(_dims({"ddp": True, "sharded_data_parallel_degree": 4}, 4))
    assert "ZeRO-3" in zero3 and "MiCS" in zero3
    rows = explain_rows(_dims({"pipeline_parallel_degree": 2}, 2), CompileSetting("blocks"))
    assert rows[0][0] == f"(adapter) {COMPILE_ENV}" and rows[0][3:5] == ("refused", "refused") and "pipeline" in rows[0][5]
    assert dict((r[0], r[4]) for r in rows)["(kernel) model_creation(fused_bias_gelu=)"] == "ignored"  # not compiled
    on = explain_rows(_dims({"ddp": True}, 2), CompileSetting("blocks"))
    assert on[0][4] == "exact" and dict((r[0], r[4]) for r in on)["(kernel) model_creation(fused_bias_gelu=)"] == "exact"
    assert explain_rows(_dims({"ddp": True}, 2), CompileSetting())[0][4] == "default"
    assert {r[0] for r in rows[1:]} == {f"(kernel) {name}" for name in SWITCHES if name != COMPILE_ENV}


def test_smp_init_refuses_compile_on_a_layout_it_cannot_run(fresh, monkeypatch):
    """smp.init's check, before any model or process group (one process cannot hold tp 2, so the
    check runs on the layout smp.init would build); a bad value stops smp.init itself."""
    from smp_adapter.runtime.init import kernel_switches

    monkeypatch.setenv(COMPILE_ENV, "blocks")
    with pytest.raises(UnsupportedFeatureError, match="tensor_parallel_degree 2"):
        kernel_switches(_dims({"tensor_parallel_degree": 2, "ddp": True}, 2), 0)
    kernel_switches(_dims({"ddp": True}, 2), 0)
    monkeypatch.setenv(COMPILE_ENV, "yes")
    with pytest.raises(SMPConfigError, match=COMPILE_ENV):
        smp.init({})


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers, self.head = nn.Linear(8, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _losses(checkpointing: bool, steps=3):
    model = smp.DistributedModel(TwoBlocks())
    if checkpointing:
        smp.set_activation_checkpointing(model.get_module().layers[1])
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        optimizer.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        optimizer.step()
    return model, losses


@pytest.mark.parametrize("options, checkpointing", [({}, False), ({}, True), ({"ddp": True, "shard_optimizer_state": True}, False)],
                         ids=["zero0", "zero0_checkpointing", "zero1"])
def test_compile_blocks_trains_the_eager_numbers(fresh, monkeypatch, options, checkpointing, capsys):
    """SMP_ADAPTER_COMPILE=blocks compiles each block of the ModuleList (not the embedding or head),
    keeps parameter names, composes with activation checkpointing, and trains the eager losses: the
    same aten ops run (aot_eager), so within float32 rounding of a reordered graph (1e-6)."""
    from torch._dynamo.utils import counters

    smp.init(options)
    _, eager = _losses(checkpointing)
    shutdown()
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setenv(COMPILE_ENV, "blocks:aot_eager")
    smp.init(options)
    model, compiled = _losses(checkpointing)
    inner = model.get_module()
    # the first block's forward is the compiled one (the second, when checkpointed, is wrapped by it)
    assert hasattr(inner.layers[0].forward, "_torchdynamo_orig_callable")
    assert not hasattr(inner.head.forward, "_torchdynamo_orig_callable")
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo did capture the blocks
    assert [n for n, _ in inner.named_parameters()] == [n for n, _ in TwoBlocks().named_parameters()]
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-6)
    assert "SMP_ADAPTER_COMPILE=blocks:aot_eager: 2 block(s) compiled" in capsys.readouterr().err
