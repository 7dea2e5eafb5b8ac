"""smp.nn.huggingface.gpt2: see smp_adapter.parallel.hf_translate (smp format == HF format here)."""

from smp_adapter.parallel.hf_translate import FAMILY_FUNCTIONS as _F

globals().update(_F["gpt2"])
__all__ = sorted(_F["gpt2"])
