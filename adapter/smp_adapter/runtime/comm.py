"""Ranks, sizes, groups and smp v1's pickled-object collectives (smp.broadcast, smp.send/recv, smp.allgather, smp.barrier).

Our choices where smp v1 is silent (docs/runtime.md): group lists are ascending global ranks;
every query before ``smp.init`` raises NotInitializedError; the process-group getters work with or
without ``ddp``; the object collectives work without ``ddp``; enum values are small ints in the order
the docs list them.
"""

from __future__ import annotations

import enum
import pickle

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.state import require_initialized


class CommGroup(enum.IntEnum):
    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2
    PP_GROUP = 3
    TP_GROUP = 4
    RDP_GROUP = 5


class RankType(enum.IntEnum):
    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2
    PP_RANK = 3
    TP_RANK = 4
    RDP_RANK = 5


WORLD, MP_GROUP, DP_GROUP = CommGroup.WORLD, CommGroup.MP_GROUP, CommGroup.DP_GROUP
PP_GROUP, TP_GROUP, RDP_GROUP = CommGroup.PP_GROUP, CommGroup.TP_GROUP, CommGroup.RDP_GROUP

_KIND = {CommGroup.WORLD: "world", CommGroup.MP_GROUP: "mp", CommGroup.DP_GROUP: "dp",
         CommGroup.PP_GROUP: "pp", CommGroup.TP_GROUP: "tp", CommGroup.RDP_GROUP: "rdp"}
_RANK_KIND = {RankType.WORLD_RANK: "world", RankType.MP_RANK: "mp", RankType.DP_RANK: "dp",
              RankType.PP_RANK: "pp", RankType.TP_RANK: "tp", RankType.RDP_RANK: "rdp"}


# -- ranks and sizes ---------------------------------------------------------------------------
def rank() -> int:
    return require_initialized("rank").rank


def size() -> int:
    return require_initialized("size").world_size


def local_rank() -> int:
    return require_initialized("local_rank").local_rank


def local_size() -> int:
    return require_initialized("local_size").local_size


def _coord(api):
    s = require_initialized(api)
    return s.dims.grid.coord(s.rank), s.dims


def pp_rank() -> int:
    return _coord("pp_rank")[0].pp


def pp_size() -> int:
    return _coord("pp_size")[1].pp


def tp_rank() -> int:
    return _coord("tp_rank")[0].tp


def tp_size() -> int:
    return _coord("tp_size")[1].tp


def rdp_rank() -> int:
    return _coord("rdp_rank")[0].rdp


def rdp_size() -> int:
    return _coord("rdp_size")[1].rdp


def dp_rank() -> int:
    return _coord("dp_rank")[0].dp_rank


def dp_size() -> int:
    return _coord("dp_size")[1].dp


def mp_rank() -> int:
    return _coord("mp_rank")[0].mp_rank


def mp_size() -> int:
    return _coord("mp_size")[1].grid.mp_size


# -- groups as rank lists and as process groups -------------------------------------------------
def _ranks(kind: str, api: str) -> list[int]:
    s = require_initialized(api)
    if kind == "world":
        return list(range(s.world_size))
    return list(getattr(s.dims.grid, f"{kind}_group")(s.rank))


def get_dp_group() -> list[int]:
    return _ranks("dp", "get_dp_group")


def get_mp_group() -> list[int]:
    return _ranks("mp", "get_mp_group")


def get_tp_group() -> list[int]:
    return _ranks("tp", "get_tp_group")


def get_pp_group() -> list[int]:
    return _ranks("pp", "get_pp_group")


def get_rdp_group() -> list[int]:
    return _ranks("rdp", "get_rdp_group")


def _process_group(kind: str, api: str):
    return getattr(require_initialized(api).groups, kind)


def get_world_process_group():
    return _process_group("world", "get_world_process_group")


def get_dp_process_group():
    return _process_group("dp", "get_dp_process_group")


def get_mp_process_group():
    return _process_group("mp", "get_mp_process_group")


def get_pp_process_group():
    return _process_group("pp", "get_pp_process_group")


def get_tp_process_group():
    return _process_group("tp", "get_tp_process_group")


def get_rdp_process_group():
    return _process_group("rdp", "get_rdp_process_group")


# -- collectives on picklable objects -----------------------------------------------------------
def _group_kind(group, api: str) -> str:
    try:
        return _KIND[CommGroup(group)]
    except (ValueError, KeyError):
        raise SMPUsageError(f"smp.{api}: group={group!r} is not an smp.CommGroup; use smp.WORLD, smp.DP_GROUP, "
                            "smp.MP_GROUP, smp.PP_GROUP, smp.TP_GROUP or smp.RDP_GROUP") from None


def barrier(group=CommGroup.WORLD) -> None:
    import torch.distributed as dist

    kind = _group_kind(group, "barrier")
    s = require_initialized("barrier")
    if s.world_size > 1:
        dist.barrier(group=getattr(s.groups, kind))


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def allgather(obj, group=CommGroup.WORLD) -> list:
    """List whose element i is the object of in-group rank i."""
    import torch.distributed as dist

    kind = _group_kind(group, "allgather")
    s = require_initialized("allgather")
    members = _ranks(kind, "allgather")
    if len(members) == 1:
        return [obj]
    gathered = [None] * s.world_size
    # all_gather_object over the gloo object group, then keep the members (ascending = in-group order).
    dist.all_gather_object(gathered, (s.rank, obj), group=s.groups.objects)
    by_rank = dict(item for item in gathered)
    return [by_rank[r] for r in members]


def _to_global(rank_in_group: int, rank_type, api: str) -> int:
    try:
        kind = _RANK_KIND[RankType(rank_type)]
    except (ValueError, KeyError):
        raise SMPUsageError(f"smp.{api}: rank_type={rank_type!r} is not an smp.RankType; use e.g. "
                            "smp.RankType.WORLD_RANK or smp.RankType.DP_RANK") from None
    members = _ranks(kind, api)
    if not 0 <= rank_in_group < len(members):
        raise SMPUsageError(f"smp.{api}: rank {rank_in_group} is outside the caller's {kind} group of size "
                            f"{len(members)}: use a rank between 0 and {len(members) - 1}")
    return members[rank_in_group]


def _send_bytes(payload: bytes, dst: int) -> None:
    import torch
    import torch.distributed as dist

    s = require_initialized("send")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=s.groups.objects)
    dist.send(data, dst=dst, group=s.groups.objects)


def _recv_bytes(src: int) -> bytes:
    import torch
    import torch.distributed as dist

    s = require_initialized("recv_from")
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src=src, group=s.groups.objects)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=s.groups.objects)
    return data.numpy().tobytes()


def send(obj, dest_rank: int, rank_type) -> None:
    """Send a picklable object to rank ``dest_rank`` of the caller's group of type ``rank_type``."""
    dst = _to_global(dest_rank, rank_type, "send")
    if dst == rank():
        raise SMPUsageError("smp.send: a rank cannot send to itself; pick another destination rank")
    _send_bytes(pickle.dumps(obj), dst)


def recv_from(src_rank: int, rank_type):
    src = _to_global(src_rank, rank_type, "recv_from")
    if src == rank():
        raise SMPUsageError("smp.recv_from: a rank cannot receive from itself; pick another source rank")
    return pickle.loads(_recv_bytes(src))


def broadcast(obj, group=CommGroup.WORLD) -> None:
    """Send ``obj`` to every other member of ``group``; they call ``recv_from(src, rank_type)``."""
    kind = _group_kind(group, "broadcast")
    payload = pickle.dumps(obj)
    me = rank()
    for member in _ranks(kind, "broadcast"):
        if member != me:
            _send_bytes(payload, member)
