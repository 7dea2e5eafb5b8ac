"""ZeRO-3 parameters (sharded data parallel): the one home of "is this a ZeRO-3 shard" and of what
the rest of the runtime needs done to shards, reached through the DeepSpeed engine's hooks
(engine.py) and never by branching on the ZeRO stage elsewhere.

* at creation: ``zero.Init`` under delayed parameter initialisation (``module_init_context``);
* at wrap time: every parameter partitioned (``partition_for_zero3``), Hugging Face weights
  initialised with gathered shards (``initialize_hf_weights_if_random``);
* for reading whole weights (saves, tensor-parallel splits, loads): ``gathered``;
* for partial state dicts: the local shards (``local_tensors`` / ``load_local_shards``).
"""

from __future__ import annotations

import contextlib

import torch

from smp_adapter.runtime.state import state


def is_zero3_parameter(p) -> bool:
    """A ZeRO-3 shard (partitioned by zero.Init or by the engine): DeepSpeed gives it a ``ds_id``."""
    return hasattr(p, "ds_id")


def shard_values(p) -> torch.Tensor:
    """The values this rank holds of ZeRO-3 parameter ``p``: its shard without the padding. DeepSpeed
    gives every rank ceil(numel / ranks) elements; the last ranks' tails past ``ds_numel`` are padding
    it never writes (torch.empty: any bits, NaN included), so a reader of values must not see them."""
    import torch.distributed as dist

    shard = p.ds_tensor
    index = dist.get_rank(group=p.ds_process_group)  # this rank's place in the parameter's ZeRO group
    valid = max(0, min(shard.numel(), p.ds_numel - index * shard.numel()))
    return shard.narrow(0, 0, valid)


def holds_zero3_parameters(module) -> bool:
    return any(is_zero3_parameter(p) for p in module.parameters())


def gathered(params, modifier_rank=None):
    """Whole values of the ZeRO-3 shards among ``params`` inside the block (collective over the ZeRO
    group: every rank passes the same parameters in the same order). ``modifier_rank``: the rank whose
    writes are kept and re-partitioned on exit (None: read only)."""
    shards = list({id(p): p for p in params if is_zero3_parameter(p)}.values())
    if not shards:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(shards, modifier_rank=modifier_rank)


@contextlib.contextmanager
def module_init_context(dtype):
    """Delayed initialisation under sharded data parallel: parameters are created already sharded
    (``zero.Init`` with the job's config and groups, groups.zero_init_context)."""
    # zero.Init patches torch.Tensor.__new__; torch._dynamo refuses to load under that patch, and
    # libraries (transformers) import it lazily while building models - so load it first.
    import torch._dynamo  # noqa: F401

    from smp_adapter.runtime.engines.deepspeed.groups import zero_init_context

    try:
        # transformers initialises (from_config) and loads (from_pretrained) ZeRO-3 shards on "rank 0"
        # while creating; each ZeRO group must do it on its own first rank (see _zero_group_rank_as_rank)
        with zero_init_context(dtype), _zero_group_rank_as_rank(), _hf_init_deferred_to_wrap_time():
            _announce_zero3_to_transformers(state.engine_config)
            yield
    finally:
        # Only while creating: afterwards a plain HF model built on one rank (e.g. to save a full
        # checkpoint) must not think it is sharded, or its collectives would wait for other ranks.
        state.hf_deepspeed_config = None


@contextlib.contextmanager
def _hf_init_deferred_to_wrap_time():
    """A Hugging Face class called directly under zero.Init runs ``post_init`` -> ``init_weights`` on
    empty shards (BERT's embedding init indexes its padding row there: IndexError). While creating,
    ``PreTrainedModel.init_weights`` does nothing, as transformers' own ZeRO-3 path does; the
    model's init then runs with gathered shards when DistributedModel wraps it
    (initialize_hf_weights_if_random). PyTorch's own layer init is left alone: it runs on whole
    tensors before zero.Init partitions them, and plain nn.Modules rely on it."""
    import sys

    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:  # a model class imported inside the block: transformers' own init runs
        yield
        return
    cls = modeling_utils.PreTrainedModel
    original = cls.__dict__["init_weights"]
    cls.init_weights = lambda self: None
    try:
        yield
    finally:
        cls.init_weights = original


def _announce_zero3_to_transformers(ds_config: dict) -> None:
    """Tell transformers that parameters are ZeRO-3 shards, so ``from_pretrained`` inside the
    context gathers each shard while loading checkpoint weights (its DeepSpeed integration).
    transformers keeps only a weak reference: the object lives in ``state`` while we create."""
    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:
        return
    state.hf_deepspeed_config = HfDeepSpeedConfig(dict(ds_config))


def register_external_parameter(module, parameter) -> None:
    """A parameter a module uses but does not own: ZeRO-3 must gather it for that module too."""
    import deepspeed

    deepspeed.zero.register_external_parameter(module, parameter)


def initialize_hf_weights_if_random(module) -> None:
    """A Hugging Face model built under zero.Init outside transformers' own ZeRO-3 path (the class
    called directly, or ``PreTrainedModel.init_weights`` disabled by the script, as the AWS GPT
    templates do "because DistributedModel will override those weights") ran its ``_init_weights``
    on empty shards, or not at all. Run the model's init with gathered shards, as transformers does
    for its own ZeRO-3 path. transformers marks every module it initialised or loaded
    (``_is_hf_initialized``) and its init skips those, so weights from ``from_pretrained`` or
    ``from_config`` are kept; what is left unmarked would otherwise keep uninitialised memory."""
    if getattr(module, "config", None) is None or not hasattr(module, "_initialize_weights"):
        return
    if not holds_zero3_parameters(module):
        return
    try:
        from transformers.integrations.deepspeed import initialize_weights_zero3
    except ImportError:  # transformers 4.x has no ZeRO-3 variant
        initialize_weights_zero3 = _initialize_weights_zero3_v4

    with _zero_group_rank_as_rank():
        initialize_weights_zero3(module)
    module.tie_weights()


def _initialize_weights_zero3_v4(model) -> None:
    """transformers 5's ``initialize_weights_zero3`` for 4.x models: each module's parameters (and its
    direct children's, which ``_init_weights`` may touch) gathered, initialised on rank 0, scattered
    back. ``_init_weights`` is called directly: 4.x's ``_initialize_weights`` skips modules its
    post_init already flagged (it ran on the empty shards)."""
    import deepspeed
    from transformers import PreTrainedModel

    def walk(m, owner) -> None:
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
    ``get_rank()`` answers the rank inside the ZeRO group, so each group's first rank initialises.
    transformers asks ``deepspeed.comm.get_rank()`` when it initialises and ``torch.distributed.get_rank()``
    when ``from_pretrained`` loads: both are answered so while a model is created under delayed init."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    zero_group = state.groups.rdp
    if zero_group is None or dist.get_world_size(zero_group) == state.world_size:
        yield
        return
    originals = (ds_comm.get_rank, dist.get_rank)
    in_zero_group = originals[1](group=zero_group)

    def answer_for(original):
        def get_rank(group=None):  # calls naming a group (DeepSpeed's own) keep their answer
            return in_zero_group if group is None else original(group=group)
        return get_rank

    ds_comm.get_rank, dist.get_rank = (answer_for(f) for f in originals)
    try:
        yield
    finally:
        ds_comm.get_rank, dist.get_rank = originals


def partition_for_zero3(module, dtype) -> None:
    """Sharded data parallel: make every parameter a ZeRO-3 shard now, when DistributedModel wraps
    the module, as smp v1 did (its sharded data parallel was DeepSpeed). Scripts read
    ``p.ds_tensor.ds_numel`` right after wrapping, before any optimizer exists. Parameters already
    partitioned (created under delayed initialisation) are left alone; new ones (tensor-parallel
    slices built from gathered shards) join them. Floating parameters are cast to the job's dtype
    first, because DeepSpeed casts only parameters it partitions itself. Then every shard's padding
    is zeroed (DeepSpeed never writes it): scripts that sum over ``p.ds_tensor`` (the AWS templates'
    parameter-norm logging) read zeros there, not whatever the memory held, and so does the optimizer's
    flat partition, which is copied from the shards."""
    from smp_adapter.runtime.engines.deepspeed.groups import partition_module

    whole = [p for p in module.parameters() if not is_zero3_parameter(p)]
    for p in whole:
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    if whole:
        partition_module(module)
    with torch.no_grad():
        for p in module.parameters():
            if is_zero3_parameter(p):
                p.ds_tensor.data[shard_values(p).numel():].zero_()


def local_tensors(module) -> dict:
    """This rank's shards of a ZeRO-3 module (copies), with its buffers."""
    sd = {n: p.ds_tensor.detach().clone().cpu() for n, p in module.named_parameters()}
    sd.update({n: b.detach().clone().cpu() for n, b in module.named_buffers()})
    return sd


def load_local_shards(module, sd: dict) -> None:
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.ds_tensor.copy_(sd[n])


def local_gradient_norm(params, is_split, tp_group, shard_group) -> float:
    """The global gradient norm of ZeRO-3 ``params`` before the optimizer step, from this rank's fp32 gradient
    partitions (DeepSpeed's public ``safe_get_local_grad``): squares summed over the sharding group, split
    weights' over the TP group too (runtime/clipping.py). Nothing is scaled here: DeepSpeed clips in its step."""
    import math

    from deepspeed.utils import safe_get_local_grad

    from smp_adapter.runtime.clipping import clip_by_global_norm

    grads = []
    for p in params:
        g = safe_get_local_grad(p) if p.requires_grad else None
        if g is not None:
            grads.append((g, is_split(p), True))
    return clip_by_global_norm(grads, math.inf, tp_group=tp_group, shard_group=shard_group)
