"""smp.nn.huggingface.t5: see smp_adapter.parallel.hf_translate (smp format == HF format here)."""

from smp_adapter.parallel.hf_translate import FAMILY_FUNCTIONS as _F

globals().update(_F["t5"])
__all__ = sorted(_F["t5"])
