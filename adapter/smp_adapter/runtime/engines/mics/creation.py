"""The MiCS engine's wrap: the model's parameters become FSDP2 shards unit by unit, and every shard is
filled tensor by tensor from where its values are, so that a rank holds its shards plus one whole tensor,
never the whole model (issue 61: a 20B model at sdp 8 must not need 80 GB on each of a node's ranks).

For each sharding unit (units.sharding_units, innermost first, the root last) the unit's parameters that
are still whole are swapped for empty stand-ins of the same shape (allocated, never written: their pages
are not resident), FSDP2 shards the unit, and then each shard gets its rows from the parameter's source:

* created under delayed initialisation: the record replays that one tensor (the undelayed values; every
  rank of the data-parallel group replays its first rank's random states, so no values travel);
* still a checkpoint file's bytes (``from_pretrained`` maps safetensors and ``.bin`` files): the rank's
  rows are read from the file with pread (runtime/file_backed.py) when every rank of the data-parallel
  group maps the same bytes of the same file, so nothing is sent and the file's pages are never mapped;
* any other tensor (a model created whole, a weight computed after loading): broadcast whole from the
  data-parallel group's first rank, one tensor at a time, and each rank keeps its rows.

Every replica thus starts from dp rank 0's weights (smp's constructor rule, ``sync_initial_state``) with
the broadcast paid only for tensors nobody else can produce. With tensor parallelism the whole tensors
were synchronised before the split (``sync_initial_state`` needs them whole), so only rows are copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.engines.mics.shards import is_shard, row_range

DEFERRED, FILE, BROADCAST, LOCAL, CUT = "deferred", "file", "broadcast", "local", "cut"
_NOT_MARKS = ("_deferred_record", "_is_param")  # a delayed tensor's own attributes, not the script's marks


def shard_units(module: nn.Module, units: list[nn.Module], shard, *, mesh, master_fp32: bool, device, group) -> None:
    """Shard ``units`` (the root last) with ``shard(unit)`` (fully_shard on ``mesh`` with the engine's
    policy), filling each shard from its source. ``master_fp32``: floating shards are fp32 (the
    optimizer's masters of a bf16/fp16 job). ``group``: the data-parallel group replicas start from the
    first rank of, or None when the whole tensors are already the same on every rank."""
    from smp_adapter.runtime.deferred_init import record_of

    record = record_of(module)
    sources = _sources(module, record, group)
    _cut_root_rows_first(units, sources, record, mesh, device)
    marks: dict[str, dict] = {}
    names = {id(p): name for name, p in module.named_parameters()}
    for unit in units:
        _materialize_other_tensors(unit, record, device)
        whole = _whole_parameters(unit)
        stand_ins: dict[int, nn.Parameter] = {}
        for m, attr, p in whole:
            if id(p) not in stand_ins:
                marks[names[id(p)]] = {k: v for k, v in vars(p).items() if k not in _NOT_MARKS}
                dtype = torch.float32 if master_fp32 and p.is_floating_point() else p.dtype
                stand_ins[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                requires_grad=p.requires_grad)
            m._parameters[attr] = stand_ins[id(p)]
        if master_fp32:  # buffers too, as before the shards existed
            unit.float()
        shard(unit)
        filled = set()
        for m, attr, p in whole:
            if id(p) not in filled:
                filled.add(id(p))
                _fill(getattr(m, attr), p, sources.pop(id(p)), record, device, group)
        del whole, stand_ins
        _release_heap()
    for name, p in module.named_parameters():  # fully_shard made new Parameter objects: the marks by name
        for key, value in marks.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)


def _whole_parameters(unit: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, attribute, parameter) for each registration of a parameter in ``unit`` not yet sharded."""
    return [(m, attr, p) for m in unit.modules() for attr, p in m._parameters.items()
            if p is not None and not is_shard(p)]


def _materialize_other_tensors(unit: nn.Module, record, device) -> None:
    """Delayed initialisation: the unit's buffers and tensor attributes (RoPE tables, masks: small) get
    their values whole; its parameters are filled one at a time after sharding."""
    if record is None:
        return
    from smp_adapter.runtime.deferred_init import DeferredTensor, materialize_in_place

    tensors = []
    for m in unit.modules():
        tensors += [b for b in m._buffers.values() if b is not None]
        tensors += [v for v in vars(m).values() if isinstance(v, DeferredTensor)]
    materialize_in_place(record, tensors, device)


def _cut_root_rows_first(units: list[nn.Module], sources: dict, record, mesh, device) -> None:
    """The root unit is sharded last, when every other shard exists: replaying its largest tensor then (a
    language model's vocabulary x hidden embedding) put the whole tensor on top of all the shards (GPT-2
    224 MiB at sdp 2: 0.68 x the model). So when the rows of the root's delayed tensors are fewer bytes
    than its largest one, each is replayed now, before any shard exists, and only its rows are kept."""
    in_units = {id(p) for unit in units[:-1] for p in unit.parameters()}
    delayed = [p for p in _unique(units[-1].parameters()) if id(p) not in in_units and sources[id(p)][0] == DEFERRED]
    rows = {id(p): row_range(tuple(p.shape), mesh=mesh) for p in delayed}
    row_bytes = sum(rows[id(p)][1] * (p.numel() // max(p.shape[0], 1)) * p.element_size() for p in delayed)
    if not delayed or row_bytes >= max(p.numel() * p.element_size() for p in delayed):
        return
    with torch.no_grad():
        for p in delayed:
            whole = record.materialize([p], device)[0]
            start, n = rows[id(p)]
            sources[id(p)] = (CUT, whole.narrow(0, start, n).clone())
            del whole
    _release_heap()


def _unique(params) -> list:
    return list({id(p): p for p in params}.values())


def _sources(module: nn.Module, record, group) -> dict[int, tuple]:
    """id(parameter) -> (how its values arrive, its file span or None), the same choice on every rank."""
    from smp_adapter.runtime.file_backed import file_spans

    params = _unique(p for p in module.parameters() if not is_shard(p))
    deferred = [record is not None and record.key_of(p) is not None for p in params]
    spans = file_spans([None if d else p for p, d in zip(params, deferred)]) if params else []
    mine = [(DEFERRED, None) if d else (FILE, s) if s is not None else (LOCAL, None) for d, s in zip(deferred, spans)]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        # a broadcast keeps this rank's own span: a receiver whose tensor maps a file takes it into a new buffer
        mine = [(kind, s) if kind == BROADCAST else (kind, span)
                for (kind, span), s in zip(_agreed(everyone), spans)]
    return {id(p): choice for p, choice in zip(params, mine)}


def _agreed(everyone: list[list[tuple]]) -> list[tuple]:
    """Every rank's (kind, span) per parameter -> the one choice all make: a file read only where all
    map the same bytes of the same file version, a replay where all recorded it, else a broadcast."""
    if len({len(e) for e in everyone}) > 1:
        raise SMPUsageError(
            f"the data-parallel ranks wrap models with different numbers of parameters ({sorted({len(e) for e in everyone})}): "
            "every rank must create the same model before smp.DistributedModel")
    out = []
    for i, first in enumerate(everyone[0]):
        kinds = {e[i][0] for e in everyone}
        if DEFERRED in kinds and len(kinds) > 1:
            raise SMPUsageError(
                "a parameter was created under delayed initialisation on some data-parallel ranks and not on others: "
                "create the model the same way on every rank (inside smp.delay_param_initialization() / "
                "smp.model_creation(), or outside on all)")
        if kinds == {FILE} and len({e[i][1] for e in everyone}) == 1:
            out.append(first)
        elif kinds == {DEFERRED}:
            out.append(first)
        else:
            out.append((BROADCAST, None))
    return out


def _fill(shard_param, source: torch.Tensor, choice: tuple, record, device, group) -> None:
    """This rank's rows of ``source``'s values into the local shard of ``shard_param``."""
    from smp_adapter.runtime.file_backed import read_rows

    kind, span = choice
    local = shard_param.to_local()
    start, rows = row_range(tuple(source.shape), shard_param)
    with torch.no_grad():
        if kind == CUT:  # the rows, replayed before the first shard existed (_cut_root_rows_first)
            local.copy_(span)
            return
        if kind == FILE:
            if rows:
                read_rows(span, tuple(source.shape), source.dtype, start, local)
            return
        if kind == DEFERRED:
            whole = record.materialize([source], device)[0]
        elif kind == BROADCAST:
            whole = _broadcast_whole(source, group, span is not None, device)
        else:
            whole = source.detach()
        if rows:  # FSDP2 shards no scalar parameters (fully_shard refuses them): every source has rows
            local.copy_(whole.narrow(0, start, rows))


def _broadcast_whole(source: torch.Tensor, group, mapped: bool, device) -> torch.Tensor:
    """``source`` as the group's first rank holds it. A receiver whose tensor still maps a file (``mapped``)
    takes it into a new buffer: writing into the mapping would give every page a private copy."""
    from smp_adapter.runtime.engines.whole_tensors import broadcast_from_first_rank

    first = dist.get_rank() == dist.get_global_rank(group, 0)
    whole = torch.empty_like(source) if mapped and not first else source.detach()
    broadcast_from_first_rank([whole], group, device)
    return whole


def _release_heap() -> None:
    from smp_adapter.runtime.deferred_init.heap import release_freed_heap

    release_freed_heap()
