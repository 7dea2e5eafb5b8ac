"""The kernel switches on a CUDA device (docs/runtime.md, "Kernel switches"; their CPU tests are
tests/unit/test_kernel_switches.py): the kernel that runs is the fused one, and the numbers are the
unswitched ones within the dtype's rounding. CI has no GPU: every test here skips cleanly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_adapter.compat.fused_optimizers import fused_supported, prefer_fused
from smp_adapter.runtime import attention, kernel_switches
from smp_adapter.translate.kernels import CompileSetting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_causal_attention_runs_a_fused_sdpa_kernel(capsys):
    attention.record_backends(0)
    attention.reset()
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    backend = attention.attention_backends()[("cuda", "bfloat16", "causal", False)]
    assert backend in ("flash", "efficient", "cudnn"), backend
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)  # bf16: 8 significant bits
    print(f"SDPA backend on {torch.cuda.get_device_name(0)}: {backend}")


def test_adamw_on_cuda_is_switched_to_fused_and_trains_the_same():
    torch.manual_seed(0)
    weights = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    fused_p = [nn.Parameter(w.clone()) for w in weights]
    plain_p = [nn.Parameter(w.clone()) for w in weights]
    fused, plain = torch.optim.AdamW(fused_p, lr=1e-2), torch.optim.AdamW(plain_p, lr=1e-2)
    assert prefer_fused(fused) is True and fused.param_groups[0]["fused"] is True
    for step in range(5):
        torch.manual_seed(step)
        grads = [torch.randn_like(w) for w in weights]
        for ps, opt in ((fused_p, fused), (plain_p, plain)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(fused_p, plain_p):  # float32: the fused kernel orders the arithmetic differently
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_fused_layer_norm_is_one_cuda_kernel():
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm

    norm = FusedLayerNorm(1024).cuda().bfloat16()
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16)
    mode = attention.op_names_mode()
    with mode:
        norm(x)
    assert [n for n in mode.names if "norm" in n] == ["native_layer_norm.default"]


def test_inductor_compiled_blocks_compute_the_eager_function():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(256), nn.Linear(256, 1024), nn.Linear(1024, 256)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ModuleList([Block(), Block()])).cuda()
    x = torch.randn(16, 64, device="cuda")

    def run():
        h = model[0](x)
        for block in model[1]:
            h = block(h)
        return h

    eager = run()
    assert kernel_switches.compile_blocks(model, CompileSetting("blocks")) == 2
    # float32: inductor's fused layer norm sums in another order (~1e-6 relative), carried through two
    # 1024-wide products
    torch.testing.assert_close(run(), eager, rtol=1e-4, atol=1e-4)
