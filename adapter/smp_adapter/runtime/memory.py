"""Memory-saving APIs (docs/runtime.md): delayed parameter initialisation, model_creation, activation
checkpointing, register_parameter.

* ``delay_param_initialization`` enters the job engine's module-init context: tensors are created
  without storage and their creation recorded (runtime/deferred_init/); the engine materialises what
  the rank keeps (``materialize_kept``: everything at wrap time at pp = 1, ZeRO-3 one module at a
  time into shards (runtime/engines/deepspeed/zero3.py), each rank's stage at pp > 1).
* ``set_activation_checkpointing`` re-runs the module's forward during backward
  (torch.utils.checkpoint, non-reentrant, which also works under ZeRO-3; the mechanism, and how
  pipeline stages get it, in runtime/activation_checkpoint.py). With ``offload_activations`` the
  tensors a checkpointed module saves go to CPU memory (torch.autograd.graph.save_on_cpu) and
  return when backward reaches them.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime import kernel_switches
from smp_adapter.runtime.activation_checkpoint import checkpoint_forward
from smp_adapter.runtime.state import require_initialized, state
from smp_adapter.translate.kernels import compile_setting_from, model_creation_switch


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True):
    require_initialized("delay_param_initialization")
    if not enabled:
        yield
        return
    with state.engine.module_init_context(_param_dtype()):
        yield


def _param_dtype():
    cfg = state.cfg
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.get_default_dtype()


_FP16_GUARD = ("an fp16 overflow guard of smp's own attention (numerics only): Hugging Face layers keep "
               "their attention math; use bf16 if fp16 attention overflows")
# smp v1's model_creation keywords for its own distributed transformer. smp-adapter splits Hugging Face
# layers in place, so on those layers these are not carried out; an smp.nn module built from a
# tp_register'ed module still receives the ones its __init__ accepts (parallel/nn.build_registered).
# The kernel switches (flash_attention, fused_softmax: carried out; fused_bias_gelu, fused_dropout: only
# with SMP_ADAPTER_COMPILE=blocks) are worded in translate/kernels.py. One home: `smp-adapter check`
# reads this table too.
MODEL_CREATION_NOT_CARRIED_OUT = {
    **{k: _switch.cuda for k in ("fused_bias_gelu", "fused_dropout")
       if not (_switch := model_creation_switch(k)).carried_out},
    "attention_in_fp32": _FP16_GUARD, "query_key_layer_scaling": _FP16_GUARD,
    "fp32_residual_addition": "residual sums in fp32 under fp16 (numerics only): not applied to Hugging Face layers",
    "use_alibi": "ALiBi attention bias: not added to Hugging Face layers (models built with ALiBi, such as BLOOM "
                 "and MPT, carry it themselves)",
    "zero_init": "replaced: under sharded data parallel every parameter is ZeRO-3-partitioned when "
                 "DistributedModel wraps the model (at creation with delayed_parameter_initialization)",
}


def _say_not_carried_out(config: dict) -> None:
    """Warn once (rank 0) for each smp-transformer keyword asked for with a non-default value."""
    from smp_adapter.runtime.state import warn_once

    compiled = compile_setting_from(os.environ).on  # fused_bias_gelu / fused_dropout: inductor fuses them
    warn_once([f"smp.model_creation({key}={config[key]!r}) is not carried out: {MODEL_CREATION_NOT_CARRIED_OUT[key]}"
               for key in sorted(config) if key in MODEL_CREATION_NOT_CARRIED_OUT and config[key]
               and not (compiled and key in ("fused_bias_gelu", "fused_dropout"))], state.rank)


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype=None, distribute_embedding: bool = False,
                   **tensor_parallel_config):
    """tensor_parallelism(...) + delay_param_initialization(...) + a default dtype while creating.
    smp's own-transformer keywords are said once not to be carried out (MODEL_CREATION_NOT_CARRIED_OUT)."""
    s = require_initialized("model_creation")
    _say_not_carried_out(tensor_parallel_config)
    kernel_switches.request(tensor_parallel_config)  # flash_attention: carried out at smp.DistributedModel
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SMPUsageError(f"model_creation(dtype=...) must be a floating torch.dtype, got {dtype!r}")
    previous = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if tensor_parallelism:
            from smp_adapter.parallel.marking import tensor_parallelism as tp_context

            stack.enter_context(tp_context(True, distribute_embedding=distribute_embedding, **tensor_parallel_config))
        if s.cfg.delayed_parameter_initialization:
            stack.enter_context(delay_param_initialization(True))
        if dtype is not None:
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False,
                                 strategy: str = "each"):
    require_initialized("set_activation_checkpointing")
    if not isinstance(module, nn.Module):
        raise SMPUsageError(f"set_activation_checkpointing takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.Sequential):
        for group in sequential_groups(module, strategy):
            for index, child in enumerate(group):
                # consecutive children of a group are checkpointed as one segment: mark the first
                # to run the whole group, the others to pass through inside it
                if index == 0:
                    checkpoint_forward(child, preserve_rng_state, group[1:])
        return
    if strategy != "each" or pack_args_as_tuple:
        raise SMPUsageError("strategy= and pack_args_as_tuple= apply only to nn.Sequential modules (smp.set_activation_checkpointing)")
    checkpoint_forward(module, preserve_rng_state, [])


def sequential_groups(seq: nn.Sequential, strategy: str) -> list[list[nn.Module]]:
    children = list(seq)
    if strategy == "each":
        return [[c] for c in children]
    if strategy == "contiguous":  # pp = 1: every layer is on this stage, one segment
        return [children] if children else []
    match = re.fullmatch(r"group_(\d+)", strategy)
    if match and int(match.group(1)) >= 1:
        n = int(match.group(1))
        return [children[i:i + n] for i in range(0, len(children), n)]
    raise SMPUsageError(f"activation checkpointing strategy {strategy!r} is not one of 'each', 'contiguous', 'group_N'")


def register_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """A parameter a module uses but does not own: ZeRO-3 must gather it for that module too."""
    require_initialized("register_parameter").engine.register_external_parameter(module, parameter)
