"""ZeRO-3 parameters (sharded data parallel): the one home of "is this a ZeRO-3 shard" and of what
the rest of the runtime needs done to shards, reached through the DeepSpeed engine's hooks
(engine.py) and never by branching on the ZeRO stage elsewhere.

* at wrap time: a model created under delayed initialisation materialised module by module, each
  module partitioned at once (``materialize_into_shards``); every other parameter partitioned
  (``partition_for_zero3``);
* for reading whole weights (saves, tensor-parallel splits, loads): ``gathered``;
* for partial state dicts: the local shards (``local_tensors`` / ``load_local_shards``).
"""

from __future__ import annotations

import contextlib

import torch



def is_zero3_parameter(p) -> bool:
    """A ZeRO-3 shard (partitioned by the engine at wrap time): DeepSpeed gives it a ``ds_id``."""
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


def register_external_parameter(module, parameter) -> None:
    """A parameter a module uses but does not own: ZeRO-3 must gather it for that module too."""
    import deepspeed

    deepspeed.zero.register_external_parameter(module, parameter)


def partition_for_zero3(module, dtype, job) -> None:
    """Sharded data parallel: make every parameter a ZeRO-3 shard now, when DistributedModel wraps
    the module, as smp v1 did (its sharded data parallel was DeepSpeed). Scripts read
    ``p.ds_tensor.ds_numel`` right after wrapping, before any optimizer exists. Parameters already
    partitioned (materialised from delayed initialisation) are left alone. Floating parameters are cast to the job's dtype
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
        partition_module(module, job)
    with torch.no_grad():
        for p in module.parameters():
            if is_zero3_parameter(p):
                p.ds_tensor.data[shard_values(p).numel():].zero_()


def materialize_into_shards(module, device, dtype, job) -> None:
    """Delayed initialisation under ZeRO-3: module by module, the tensors created without storage get
    the values the script would have got without delaying (the record's replay, runtime/deferred_init/),
    floating parameters are cast to the job's dtype, and the parameters become ZeRO-3 shards at once.
    So a rank never holds more than its shards plus one module's whole tensors, and the weights are the
    undelayed ones whatever the model's init does (transformers' ``_init_weights``, tied embeddings):
    zero.Init at creation ran that init on empty shards, so embeddings kept ``nn.Embedding``'s N(0, 1)
    and a tied GPT-2 started at loss 577 instead of 9.2. Every rank of a replica group replays its
    first rank's random states (``sync_initial_state``), and each parameter is broadcast from its ZeRO
    group's first rank before partitioning, so every shard is a slice of one model."""
    from smp_adapter.runtime.deferred_init import materialize_in_place, own_tensors, record_of
    from smp_adapter.runtime.engines.deepspeed.groups import zero3_partitioner

    record = record_of(module)
    if record is None:
        return
    partition = zero3_partitioner(job)
    for m in module.modules():
        materialize_in_place(record, own_tensors(m), device)
        whole = [p for p in m.parameters(recurse=False) if not is_zero3_parameter(p)]
        for p in whole:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        partition(whole)


@contextlib.contextmanager
def fp32_master_shared_with_partition():
    """Inside: a ZeRO-3 optimizer DeepSpeed builds steps the rank's parameter partition itself when that
    partition is already fp32 on the optimizer's device (an fp32 job), instead of a clone of it.
    DeepSpeed means to (stage3.py, "we don't need another copy of the weights"), but compares the
    partition's ``torch.device`` with its accelerator's device *name*, a string, which is never equal:
    every fp32 ZeRO-3 rank held a second copy of its partition (128 MiB of the 256 MiB MLP's rank at sdp
    2, as the kernel counts it). The comparison is made with the device as a ``torch.device`` while the
    partitions are created, and the name is put back. fp16/bf16 jobs keep their fp32 master: the dtypes
    differ, DeepSpeed clones as before."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions

    def create_fp32_partitions(self):
        name = self.device
        if isinstance(name, str):
            self.device = torch.device(name)
        try:
            return original(self)
        finally:
            self.device = name

    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_fp32_partitions
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = original


def consecutive_view(tensors, dtype):
    """One flat view over ``tensors`` when they lie end to end in one storage in their order, are
    contiguous and of ``dtype``; else None."""
    if not tensors or any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
        return None
    first, storage = tensors[0], tensors[0].untyped_storage()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    total = offset - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,))


def step_on_gradient_partitions_in_place(optimizer) -> None:
    """A ZeRO-3 optimizer's step reads each sub group's gradients where the reduction left them (its
    slice of DeepSpeed's flat gradient-partition buffer) instead of a flattened copy. DeepSpeed 0.19.8
    (stage3.py ``_prepare_fp32_grad_for_sub_group``) flattens the sub group's gradient views, which
    already lie end to end in that buffer, into a new tensor for every step: a second copy of the rank's
    gradient partition at the step, the run's peak (+95 MiB on the 256 MiB MLP's rank at sdp 2, as the
    kernel counts it). The copy was read by the step and freed after it; nothing reads the buffer between
    the step and the next reduction, which overwrites it (micro_step_id 0), so the view is the same
    numbers. Anything else (offload, other dtypes, padding) keeps DeepSpeed's path."""
    original = optimizer._prepare_fp32_grad_for_sub_group

    def prepare(sub_group_id):
        master = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        view = consecutive_view(optimizer.averaged_gradients[sub_group_id] or [], master.dtype)
        if view is None or view.numel() != master.numel() or view.device != master.device:
            return original(sub_group_id)
        master.grad = view.view(master.shape)
        optimizer.averaged_gradients[sub_group_id] = None

    optimizer._prepare_fp32_grad_for_sub_group = prepare


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
