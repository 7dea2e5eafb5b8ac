"""The libraries smp-adapter runs on, as told apart from the training script's own code (a leaf: no
torch import).

Two shims answer the script differently from the libraries: CUDA on CPU ranks
(compat/cuda_on_cpu.py: capability queries say "one GPU per rank" to the script only) and the apex
fallback (apex_fallback/: ``import apex`` finds the fallback for the script only). Libraries keep
seeing the real machine, so they keep choosing their own CPU and no-apex paths (Megatron-core picks
its norm and optimizer implementations by whether ``import apex`` succeeds; DeepSpeed counts apex's
FusedAdam among its fused optimizers).
"""

from __future__ import annotations

LIBRARIES = ("torch", "deepspeed", "megatron", "transformers", "accelerate", "smp_adapter", "smdistributed",
             "apex", "triton", "safetensors", "huggingface_hub", "datasets", "numpy", "transformer_engine")


def is_library_module(module_name: str) -> bool:
    """True for a module of one of those libraries (by its top-level package)."""
    return module_name.split(".", 1)[0] in LIBRARIES
