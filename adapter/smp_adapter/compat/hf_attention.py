"""Hugging Face models switched from eager attention to SDPA, on every transformers of the supported range:
what smp's ``model_creation(flash_attention=True)`` (or ``fused_softmax=True``) becomes at
``smp.DistributedModel`` (runtime/kernel_switches.py decides when; translate/kernels.py says it in words).

A release whose models have ``set_attn_implementation`` is asked to switch; the 4.x releases before it
(4.38 among them) choose the attention class when a layer is built, so the class itself is swapped
(``_swap_attention_classes``).
Imports nothing of smp-adapter's runtime: it is handed the module to switch."""

from __future__ import annotations

import sys

from torch import nn


def use_sdpa_attention(module: nn.Module) -> list[str]:
    """Hugging Face models inside ``module`` whose attention is 'eager' and whose class has an SDPA
    path switched to 'sdpa'; returns the class names switched. Models without one keep theirs."""
    switched = []
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) != "eager" or not getattr(m, "_supports_sdpa", False):
            continue
        if hasattr(m, "set_attn_implementation"):
            m.set_attn_implementation("sdpa")
            switched.append(type(m).__name__)
        elif _swap_attention_classes(m, config):
            switched.append(type(m).__name__)
    return switched


def eager_attention_kept(module: nn.Module) -> list[str]:
    """The class names of Hugging Face models inside ``module`` whose attention is still 'eager' (sorted):
    those this transformers release has no SDPA path for."""
    return sorted({type(m).__name__ for m in module.modules()
                   if getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"
                   and hasattr(m, "_supports_sdpa")})


def _swap_attention_classes(model: nn.Module, config) -> bool:
    """transformers 4.x before ``set_attn_implementation`` (4.38 among them): the attention class is chosen
    when a layer is built, from the modeling file's ``<FAMILY>_ATTENTION_CLASSES`` table ({"eager": ...,
    "sdpa": ...}, the SDPA class a subclass of the eager one with the same parameters); the masks follow
    ``config._attn_implementation`` (or a ``_use_sdpa`` flag set from it) at every forward. So: each eager
    attention module takes its table's SDPA class, and the config and flags say 'sdpa'. False (nothing
    changed) where the modeling file has no such table."""
    swaps = []
    for sub in model.modules():
        tables = [v for k, v in vars(sys.modules.get(type(sub).__module__, object)).items()
                  if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict)]
        for table in tables:
            eager, sdpa = table.get("eager"), table.get("sdpa")
            if type(sub) is eager and sdpa is not None and issubclass(sdpa, eager):
                swaps.append((sub, sdpa))
    if not swaps:
        return False
    for sub, sdpa in swaps:
        sub.__class__ = sdpa
    config._attn_implementation = "sdpa"
    for sub in model.modules():
        if hasattr(sub, "_use_sdpa"):
            sub._use_sdpa = True
    return True
