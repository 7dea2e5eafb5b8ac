"""Memory-saving APIs (spec §2.9): delayed parameter initialisation, model_creation, activation
checkpointing, register_parameter.

* ``delay_param_initialization`` under sharded data parallel enters ``deepspeed.zero.Init``:
  parameters are created already sharded, never whole on one rank. Without sdp it changes nothing
  (parameters are created normally; the engine places them at wrap time) - our documented choice.
* ``set_activation_checkpointing`` re-runs the module's forward during backward
  (torch.utils.checkpoint, non-reentrant, which also works under ZeRO-3). With
  ``offload_activations`` the tensors a checkpointed module saves go to CPU memory
  (torch.autograd.graph.save_on_cpu) and return when backward reaches them.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.state import require_initialized, state


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True):
    s = require_initialized("delay_param_initialization")
    if not enabled or s.dims.zero_stage != 3:
        yield
        return
    # zero.Init patches torch.Tensor.__new__; torch._dynamo refuses to load under that patch, and
    # libraries (transformers) import it lazily while building models - so load it first.
    import torch._dynamo  # noqa: F401

    from smp_adapter.runtime.engines.deepspeed.groups import zero_init_context
    from smp_adapter.translate.deepspeed import to_deepspeed_config

    try:
        with zero_init_context(_param_dtype()):
            _announce_zero3_to_transformers(to_deepspeed_config(s.dims, backend=s.backend))
            yield
    finally:
        # Only while creating: afterwards a plain HF model built on one rank (e.g. to save a full
        # checkpoint) must not think it is sharded, or its collectives would wait for other ranks.
        state.hf_deepspeed_config = None


def _announce_zero3_to_transformers(ds_config: dict) -> None:
    """Tell transformers that parameters are ZeRO-3 shards, so ``from_pretrained`` inside the
    context gathers each shard while loading checkpoint weights (its DeepSpeed integration).
    transformers keeps only a weak reference: the object lives in ``state`` while we create."""
    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:
        return
    state.hf_deepspeed_config = HfDeepSpeedConfig(dict(ds_config))


def initialize_hf_weights_if_random(module: nn.Module) -> None:
    """A Hugging Face model built from a config under zero.Init got PyTorch's default init (its own
    ``_init_weights`` ran on empty shards). Re-run the model's init with gathered shards, as
    transformers does for its own ZeRO-3 path. Models loaded with from_pretrained keep their weights."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "_initialize_weights") or getattr(config, "_name_or_path", ""):
        return
    if not any(hasattr(p, "ds_id") for p in module.parameters()):
        return
    try:
        from transformers.integrations.deepspeed import initialize_weights_zero3
    except ImportError:  # transformers 4.x has no ZeRO-3 variant
        initialize_weights_zero3 = _initialize_weights_zero3_v4

    with _zero_group_rank_as_rank():
        initialize_weights_zero3(module)
    module.tie_weights()


def _initialize_weights_zero3_v4(model: nn.Module) -> None:
    """transformers 5's ``initialize_weights_zero3`` for 4.x models: each module's parameters (and its
    direct children's, which ``_init_weights`` may touch) gathered, initialised on rank 0, scattered
    back. ``_init_weights`` is called directly: 4.x's ``_initialize_weights`` skips modules its
    post_init already flagged (it ran on the empty shards)."""
    import deepspeed
    from transformers import PreTrainedModel

    def walk(m: nn.Module, owner) -> None:
        for child in m.children():
            walk(child, child if isinstance(child, PreTrainedModel) else owner)
        params = list(m.parameters(recurse=False))
        for child in m.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if deepspeed.comm.get_rank() == 0:
                    owner._init_weights(m)

    walk(model, model)


@contextlib.contextmanager
def _zero_group_rank_as_rank():
    """transformers initialises a gathered ZeRO-3 module on ``deepspeed.comm.get_rank() == 0`` and
    broadcasts from the ZeRO group's first rank. With tensor parallelism the ZeRO group is the RDP
    group, and every group but the one holding global rank 0 would broadcast uninitialised memory
    (seen as NaN losses at tp 2 x sdp 2 with delayed init). While it runs, the argument-free
    ``get_rank()`` answers the rank inside the ZeRO group, so each group's first rank initialises."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    zero_group = state.groups.rdp
    if zero_group is None or dist.get_world_size(zero_group) == state.world_size:
        yield
        return
    original = ds_comm.get_rank

    def rank_in_zero_group(group=None):  # DeepSpeed's own calls pass group= and keep their answer
        return dist.get_rank(group=zero_group) if group is None else original(group=group)

    ds_comm.get_rank = rank_in_zero_group
    try:
        yield
    finally:
        ds_comm.get_rank = original


def partition_for_zero3(module: nn.Module) -> None:
    """Sharded data parallel: make every parameter a ZeRO-3 shard now, when DistributedModel wraps
    the module, as smp v1 did (its sharded data parallel was DeepSpeed). Scripts read
    ``p.ds_tensor.ds_numel`` right after wrapping, before any optimizer exists. Parameters already
    partitioned (created under delayed initialisation) are left alone; new ones (tensor-parallel
    slices built from gathered shards) join them. Floating parameters are cast to the job's dtype
    first, because DeepSpeed casts only parameters it partitions itself."""
    from smp_adapter.runtime.engines.deepspeed.groups import partition_module

    whole = [p for p in module.parameters() if not hasattr(p, "ds_id")]
    if not whole:
        return
    dtype = _param_dtype()
    for p in whole:
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    partition_module(module)


def _param_dtype():
    cfg = state.cfg
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.get_default_dtype()


_KERNEL = "a fused-kernel switch (speed only, same math): Hugging Face layers keep their own kernels"
_FP16_GUARD = ("an fp16 overflow guard of smp's own attention (numerics only): Hugging Face layers keep "
               "their attention math; use bf16 if fp16 attention overflows")
# smp v1's model_creation keywords for its own distributed transformer. smp-adapter splits Hugging Face
# layers in place, so on those layers they are not carried out; an smp.nn module built from a
# tp_register'ed module still receives the ones its __init__ accepts (parallel/nn.build_registered).
# One home: `smp-adapter check` reads this table too.
MODEL_CREATION_NOT_CARRIED_OUT = {
    "flash_attention": _KERNEL + " (transformers' scaled_dot_product_attention where the model supports it)",
    "fused_softmax": _KERNEL, "fused_dropout": _KERNEL, "fused_bias_gelu": _KERNEL,
    "attention_in_fp32": _FP16_GUARD, "query_key_layer_scaling": _FP16_GUARD,
    "fp32_residual_addition": "residual sums in fp32 under fp16 (numerics only): not applied to Hugging Face layers",
    "use_alibi": "ALiBi attention bias: not added to Hugging Face layers (models built with ALiBi, such as BLOOM "
                 "and MPT, carry it themselves)",
    "zero_init": "replaced: under sharded data parallel every parameter is ZeRO-3-partitioned when "
                 "DistributedModel wraps the model (at creation with delayed_parameter_initialization)",
}


def _say_not_carried_out(config: dict) -> None:
    """Warn once (rank 0) for each smp-transformer keyword asked for with a non-default value."""
    from smp_adapter.runtime.init import warn_once

    warn_once([f"smp.model_creation({key}={config[key]!r}) is not carried out: {MODEL_CREATION_NOT_CARRIED_OUT[key]}"
               for key in sorted(config) if key in MODEL_CREATION_NOT_CARRIED_OUT and config[key]], state.rank)


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype=None, distribute_embedding: bool = False,
                   **tensor_parallel_config):
    """tensor_parallelism(...) + delay_param_initialization(...) + a default dtype while creating.
    smp's own-transformer keywords are said once not to be carried out (MODEL_CREATION_NOT_CARRIED_OUT)."""
    s = require_initialized("model_creation")
    _say_not_carried_out(tensor_parallel_config)
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
        for group in _sequential_groups(module, strategy):
            for index, child in enumerate(group):
                # consecutive children of a group are checkpointed as one segment: mark the first
                # to run the whole group, the others to pass through inside it
                if index == 0:
                    _checkpoint_forward(child, preserve_rng_state, group[1:])
        return
    if strategy != "each" or pack_args_as_tuple:
        raise SMPUsageError("strategy= and pack_args_as_tuple= apply only to nn.Sequential modules (spec §2.9)")
    _checkpoint_forward(module, preserve_rng_state, [])


def _sequential_groups(seq: nn.Sequential, strategy: str) -> list[list[nn.Module]]:
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


def _checkpoint_forward(module: nn.Module, preserve_rng_state: bool, followers: list[nn.Module]) -> None:
    if getattr(module, "_smp_checkpointed", False):
        return
    original = module.forward
    # transformers 4.x blocks return a tuple (hidden_states, present, ...) whose first element the
    # model's loop feeds to the next block: length of the leader's last output, 0 for a tensor
    out_len = [0]

    def follower_identity(x, *a, **k):
        return (x,) + (None,) * (out_len[0] - 1) if out_len[0] else x

    for f in followers:  # run inside the leader's segment; their own forward is then the identity
        f._smp_original_forward = f.forward
        f.forward = follower_identity
        f._smp_checkpointed = True

    def segment(*args, **kwargs):
        out = original(*args, **kwargs)
        out_len[0] = len(out) if isinstance(out, tuple) else 0
        # a follower gets the previous output in place of the first argument and the leader's other
        # arguments: Hugging Face blocks all take (hidden_states, mask, ..., **kwargs) from one loop
        for f in followers:
            out = f._smp_original_forward(out[0] if isinstance(out, tuple) else out, *args[1:], **kwargs)
        return out

    def checkpointed_forward(*args, **kwargs):
        if not (torch.is_grad_enabled() and module.training):
            return segment(*args, **kwargs)
        offload = state.initialized and state.cfg.offload_activations and torch.cuda.is_available()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
        with ctx:
            return torch.utils.checkpoint.checkpoint(segment, *args, use_reentrant=False,
                                                     preserve_rng_state=preserve_rng_state, **kwargs)

    module.forward = checkpointed_forward
    module._smp_checkpointed = True


def register_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """A parameter a module uses but does not own: ZeRO-3 must gather it for that module too."""
    s = require_initialized("register_parameter")
    if s.dims.zero_stage == 3:
        import deepspeed

        deepspeed.zero.register_external_parameter(module, parameter)
