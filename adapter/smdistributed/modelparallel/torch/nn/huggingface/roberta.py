"""smp.nn.huggingface.roberta: see smp_adapter.parallel.hf_translate (smp format == HF format here)."""

from smp_adapter.parallel.hf_translate import FAMILY_FUNCTIONS as _F

globals().update(_F["roberta"])
__all__ = sorted(_F["roberta"])
