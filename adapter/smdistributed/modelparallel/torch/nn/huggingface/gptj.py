"""smp.nn.huggingface.gptj: see smp_adapter.parallel.hf_translate (smp format == HF format here)."""

from smp_adapter.parallel.hf_translate import FAMILY_FUNCTIONS as _F

globals().update(_F["gptj"])
__all__ = sorted(_F["gptj"])
