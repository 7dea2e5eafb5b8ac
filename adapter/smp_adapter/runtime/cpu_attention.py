"""Float16 attention on CPUs without AVX512: torch's math kernel there, every other attention untouched.

torch 2.13's CPU flash-attention kernel for float16 can pack its operands with AVX512 instructions
and then raises "pack_vnni2 is only supported when avx512 is supported" when torch dispatches below
AVX512 (ATEN_CPU_CAPABILITY=avx2/default, or a CPU without AVX512) for sequences of 32 tokens and
more. It was met on an Intel machine under ATEN_CPU_CAPABILITY=avx2; an AMD EPYC (Zen 4) under the
same setting ran it (the packing depends on what else the CPU has). A GPU script's fp16 attention
would then fail on such CPU ranks; the math kernel computes the same attention.

The rule, for every process that imports smp (whatever started it, CUDA on CPU or not): on such a
CPU, an attention whose query is a float16 CPU tensor runs the math kernel; float32, bfloat16, CUDA
tensors and every CPU with AVX512 keep the kernel torch chooses, so nothing else computes a different
number. (It used to be done by turning flash off for the whole process under CUDA on CPU: float32
attention then rounded differently on those CPUs, and a launched rank, mode on, and a rank started
otherwise disagreed at the 1e-7 level.)

Two ways in: eager calls reach ``torch.nn.functional.scaled_dot_product_attention``, wrapped by
``install()`` at the first smp import (names bound to torch's function before that keep it); a
traced pipeline stage calls the aten op itself, so the pipeline engine runs an fp16 job's step
inside ``math_kernel_for(torch.float16)``.
"""

from __future__ import annotations

import contextlib

import torch

FP16_FLASH_RAISES = torch.backends.cpu.get_cpu_capability() != "AVX512"
_installed = False


def _math_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def math_kernel_for(dtype: torch.dtype | None, device: torch.device | str | None = "cpu"):
    """A context in which attention of ``dtype`` on ``device`` cannot reach the raising kernel: the
    math kernel for float16 on the CPU of a machine without AVX512, nothing otherwise."""
    device = torch.device(device or "cpu")
    if FP16_FLASH_RAISES and dtype == torch.float16 and device.type == "cpu":
        return _math_kernel()
    return contextlib.nullcontext()


def install() -> bool:
    """Wrap the functional on CPUs without AVX512 (once); False where torch's own is kept."""
    global _installed
    if _installed or not FP16_FLASH_RAISES:
        return _installed
    torch_attention = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, *args, **kwargs):
        if query.dtype == torch.float16 and query.device.type == "cpu":
            with _math_kernel():
                return torch_attention(query, key, value, *args, **kwargs)
        return torch_attention(query, key, value, *args, **kwargs)

    scaled_dot_product_attention.__doc__ = torch_attention.__doc__
    scaled_dot_product_attention.__wrapped__ = torch_attention
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    _installed = True
    return True
