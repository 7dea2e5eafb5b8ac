"""The MiCS engine's sharding units: which submodules torch FSDP2's ``fully_shard`` shards one at a time
(``sharding_units``). The rule's constants and its text are translate/mics.py's (``UNIT_MIN_ELEMENTS``,
``splits_block``), read by plan too (plan/mics_units.py counts the same units from a model's spec); the
repeated blocks are those SMP_ADAPTER_COMPILE=blocks compiles (runtime/kernel_switches.py), so each
compiled block is one unit, as torchtitan compiles before fully_shard."""

from __future__ import annotations

from torch import nn

from smp_adapter.runtime.kernel_switches import repeated_blocks
from smp_adapter.translate.mics import UNIT_MIN_ELEMENTS, splits_block  # the units rule's home, beside its text


def sharding_units(module: nn.Module, sdp: int = 1) -> list[nn.Module]:
    """The submodules FSDP2 gathers one at a time, innermost first; the root module is the last unit and
    holds what is left (embeddings, heads, norms). The size rule: a submodule becomes a unit once its
    parameters outside smaller units reach ``UNIT_MIN_ELEMENTS``. A model with repeated blocks
    (runtime/kernel_switches.py ``repeated_blocks``: every parameter-holding element of an ``nn.ModuleList``,
    the same blocks SMP_ADAPTER_COMPILE=blocks compiles): each block is a unit, whatever its size, and
    nothing outside the blocks but the root; a block holding more than 1/BLOCK_SPLIT of the rank's
    shard (the model's parameters / sdp) comes after the units the size rule finds inside it (a GPT-2
    block of width 1024 at sdp 2: its four projections, the block keeping its norms). Any other model
    (an ``nn.Sequential`` of layers, a module of named children): the size rule over the whole tree. A
    parameter shared by two modules (a tied weight) stays with the root: FSDP2 shards each parameter in
    one unit."""
    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    units: list[nn.Module] = []
    claimed: set[int] = set()

    def claim(m: nn.Module, top: nn.Module) -> None:
        """The size rule over m's subtree, innermost first; ``top`` itself is left to the caller."""
        for child in m.children():
            claim(child, top)
        free = [p for p in m.parameters() if id(p) not in claimed]
        if m is top or any(owners.get(id(p), 0) > 1 for p in free):
            return
        if sum(p.numel() for p in free) >= UNIT_MIN_ELEMENTS:
            units.append(m)
            claimed.update(id(p) for p in free)

    blocks = repeated_blocks(module)
    if not blocks:
        claim(module, module)
        return units
    model_numel = sum(p.numel() for p in module.parameters())
    for block in blocks:
        if splits_block(sum(p.numel() for p in block.parameters()), model_numel, sdp):
            claim(block, block)
        units.append(block)
        claimed.update(id(p) for p in block.parameters())
    return units
