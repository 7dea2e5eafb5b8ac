"""smp.nn: smp v1's tensor-parallel modules (docs/runtime.md) on Megatron-core layers, and FusedLayerNorm /
FlashAttentionLayer without apex (smp_adapter/parallel/fused_modules.py)."""

from smp_adapter.parallel.fused_modules import FlashAttentionLayer, FusedLayerNorm  # noqa: F401


def __getattr__(name):
    if name == "huggingface":  # smp.nn.huggingface.gpt2.translate_... works without importing it first, as in smp v1
        import importlib

        return importlib.import_module(f"{__name__}.huggingface")
    from smp_adapter.parallel import nn as _impl

    try:
        return getattr(_impl, name)
    except AttributeError:
        raise AttributeError(f"smp.nn has no attribute {name!r}") from None
