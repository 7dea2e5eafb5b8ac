"""CPU attention whose kernel raises (smp_adapter/runtime/attention.py): each process probes torch's
own kernel per dtype and routes exactly the dtypes that raise to the math kernel, in every process that
imports smp, CUDA on CPU or not. Which dtype raises depends on the CPU (none, float16 or bfloat16 under
ATEN_CPU_CAPABILITY=avx2 on the machines met so far), so no test here names one: the subprocess cases
compare the probe's verdict against torch's own kernel called directly in the same process, and the
in-process cases simulate a verdict. Each capability runs in a fresh interpreter (read once per process)."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import smdistributed.modelparallel.torch  # noqa: F401  (its import installs the wrapper)
from smp_adapter.runtime import attention
from smp_adapter.runtime.attention import op_names_mode

ROOT = Path(__file__).resolve().parents[2]

ATTENTION = """
import json, torch
F = torch.nn.functional
torch_attention = F.scaled_dot_product_attention  # torch's own, bound before smp is imported

def raises(dtype, shape):  # torch's own kernel choice, asked directly
    q, k, v = (torch.randn(shape).to(dtype).requires_grad_() for _ in range(3))
    try:
        torch_attention(q, k, v, is_causal=True).float().sum().backward()
    except RuntimeError:
        return True
    return False

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
direct = {str(d): raises(d, (1, 1, 128, 64)) or raises(d, (2, 4, 64, 16)) for d in DTYPES}
import smdistributed.modelparallel.torch as smp
import smdistributed.modelparallel.torch  # noqa: F401  (its import installs the wrapper)
from smp_adapter.runtime import attention
from smp_adapter.runtime.attention import math_kernel_for
routed = [str(d) for d in attention.routed_dtypes()]
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
ref_q = q.clone().requires_grad_()
ref = torch_attention(ref_q, k, v, is_causal=True)
ref.sum().backward()
aten = torch.ops.aten.scaled_dot_product_attention.default
per_dtype = {}
for dtype in DTYPES:
    h = q.detach().to(dtype).clone().requires_grad_()
    out = F.scaled_dot_product_attention(h, k.to(dtype), v.to(dtype), is_causal=True)
    out.float().sum().backward()
    kept = None
    if str(dtype) not in routed:  # torch's kernel kept: bit-equal to torch's own call
        kept = torch.equal(out, torch_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True))
    # a traced pipeline stage calls the aten op, past the functional: the pipeline runs a step in this block
    with math_kernel_for(dtype, "cpu"):
        staged = aten(h, k.to(dtype), v.to(dtype), None, 0.0, True)
    per_dtype[str(dtype)] = {"kept_bit_equal": kept, "aten_staged": (staged - out).abs().max().item(),
                             "out": (out.float() - ref).abs().max().item(),
                             "grad": (h.grad.float() - ref_q.grad).abs().max().item()}
print("RESULT " + json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "direct": direct,
                              "routed": routed, "per_dtype": per_dtype,
                              "flash_enabled": torch.backends.cuda.flash_sdp_enabled()}))
"""


def _result(code: str, env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SMP_ADAPTER_CUDA_ON_CPU", "ATEN_CPU_CAPABILITY")}
    env.update({"PYTHONPATH": str(ROOT / "adapter"), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", **env_extra})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("capability, mode", [(None, "0"), ("avx2", "0"), ("avx2", "1"), ("default", "0")],
                         ids=["own", "avx2-cuda_on_cpu_off", "avx2-cuda_on_cpu_on", "default"])
def test_attention_of_every_dtype_runs_and_only_what_raises_changes_kernel(capability, mode):
    """Under each forced capability: the dtypes the probe routed are exactly those whose torch kernel
    raises when called directly; attention of every dtype runs forward and backward; a kept dtype is
    bit-equal to torch's own call and flash stays enabled for the process; every dtype is within its
    precision's error of float32 (64 keys, values ~1: float16 5e-3 / 5e-2, bfloat16 3e-2 / 3e-1 for
    output / gradient, 8 and 3 fewer mantissa bits than float16 and float32's 1e-5); the aten op inside
    math_kernel_for(dtype) computes the functional's result bit for bit (the same kernel ran). The
    numbers do not depend on the CUDA-on-CPU mode (issue 55)."""
    env = {"SMP_ADAPTER_CUDA_ON_CPU": mode, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
    out = _result(ATTENTION, env)
    if capability:
        assert out["capability"] == capability.upper()
    assert sorted(out["routed"]) == sorted(d for d, raised in out["direct"].items() if raised), out
    assert out["flash_enabled"], out
    bounds = {"torch.float32": (1e-5, 1e-4), "torch.bfloat16": (3e-2, 3e-1), "torch.float16": (5e-3, 5e-2)}
    for dtype, got in out["per_dtype"].items():
        assert got["kept_bit_equal"] in (True, None), (dtype, out)
        assert (got["kept_bit_equal"] is None) == (dtype in out["routed"]), (dtype, out)
        assert got["out"] < bounds[dtype][0] and got["grad"] < bounds[dtype][1], (dtype, out)
        assert got["aten_staged"] == 0.0, (dtype, out)


def _ran(dtype):
    """The aten kernels SDPA dispatched to for a small causal call of ``dtype`` through the functional."""
    q, k, v = (torch.randn(1, 2, 64, 16).to(dtype) for _ in range(3))
    with op_names_mode() as mode:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return " ".join(mode.names)


def test_a_dtype_the_probe_found_raising_runs_the_math_kernel_and_no_other(monkeypatch):
    """Simulated verdict 'bfloat16 raises': bfloat16 CPU attention runs the math kernel, float32 and float16
    keep torch's flash kernel; math_kernel_for routes bfloat16 only, and a CUDA device never."""
    assert attention._installed  # smp's import installed it
    monkeypatch.setattr(attention, "_verdicts", {torch.float32: False, torch.bfloat16: True, torch.float16: False})
    assert attention.routed_dtypes() == [torch.bfloat16]
    assert "flash" not in _ran(torch.bfloat16)
    assert "flash" in _ran(torch.float32) and "flash" in _ran(torch.float16)
    with attention.math_kernel_for(torch.bfloat16, None):  # no device yet: the CPU
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # put back after the block
    for dtype, device in ((torch.float32, "cpu"), (torch.float16, "cpu"), (None, "cpu"), (torch.bfloat16, "cuda")):
        with attention.math_kernel_for(dtype, device):
            assert torch.backends.cuda.flash_sdp_enabled(), (dtype, device)


def test_the_probe_reports_what_torch_does(monkeypatch):
    """The probe's verdict is torch's kernel raising or not (a stand-in kernel that raises for float16
    only), forward or backward, and it is asked once per dtype per process."""
    calls = []

    def stand_in(q, k, v, *args, **kwargs):
        calls.append(q.dtype)
        if q.dtype == torch.float16:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return q.clone()

    monkeypatch.setattr(attention, "_verdicts", {})
    monkeypatch.setattr(attention, "_torch_sdpa", stand_in)
    assert [attention.probe(d) for d in (torch.float32, torch.float16, torch.float16)] == [False, True, True]
    assert calls.count(torch.float16) == 1  # cached


def test_a_packing_error_the_probe_missed_routes_its_dtype_from_then_on(monkeypatch):
    """A shape the probe did not cover raises torch's packing error: the call is retried on the math kernel
    (its result returned), the dtype is routed from then on, and one warning says so; other errors pass."""
    def stand_in(q, k, v, *args, **kwargs):
        if torch.backends.cuda.flash_sdp_enabled():
            if q.dtype == torch.bfloat16:
                raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
            if q.dtype == torch.float64:
                raise RuntimeError("another failure")
        return q + 1

    monkeypatch.setattr(attention, "_verdicts", {torch.float32: False, torch.bfloat16: False})
    monkeypatch.setattr(attention, "_torch_sdpa", stand_in)
    q = torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(attention.scaled_dot_product_attention(q, q, q), q + 1)
        assert torch.equal(attention.scaled_dot_product_attention(q, q, q), q + 1)
    assert len([w for w in caught if "math kernel from now on" in str(w.message)]) == 1
    assert attention.routed_dtypes() == [torch.bfloat16]
    monkeypatch.setitem(attention._verdicts, torch.float64, False)
    with pytest.raises(RuntimeError, match="another failure"):
        attention.scaled_dot_product_attention(q.double(), q.double(), q.double())


def test_one_wrapper_installed_once_and_taken_out_whole():
    """The recording and the CPU rule are one wrapper over torch's own functional (runtime/attention.py):
    uninstall puts torch's function back, install wraps it again without probing again."""
    wrapper = torch.nn.functional.scaled_dot_product_attention
    assert wrapper is attention.scaled_dot_product_attention
    torch_own = wrapper.__wrapped__
    assert not hasattr(torch_own, "__wrapped__")  # nothing of smp's beneath it
    verdicts = dict(attention._verdicts)
    try:
        attention.uninstall()
        assert torch.nn.functional.scaled_dot_product_attention is torch_own and not attention._installed
    finally:
        assert attention.install()
    assert torch.nn.functional.scaled_dot_product_attention is wrapper and attention._verdicts == verdicts
