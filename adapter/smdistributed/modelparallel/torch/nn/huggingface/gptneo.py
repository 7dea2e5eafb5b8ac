"""smp.nn.huggingface.gptneo: state-dict translations (smp_adapter.parallel.hf_translate: smp format == HF format
here) and smp v1's hook getters (smp_adapter.parallel.hf_hooks: the module is split in place)."""

from smp_adapter.parallel.hf_hooks import FAMILY_HOOKS as _H
from smp_adapter.parallel.hf_translate import FAMILY_FUNCTIONS as _F

_NAMES = {**_F["gptneo"], **_H.get("gptneo", {})}
globals().update(_NAMES)
__all__ = sorted(_NAMES)
