"""MiCS's FSDP2 sharding units as plan counts them: the runtime's rule (runtime/engines/mics/units.py
``sharding_units``) applied to the model spec's module trees (ModelSpec.layer_modules, else
plan/zero3.py ``default_trees``: a layer's own module around one module per tensor).

Each transformer layer is a unit. A layer holding more than 1/BLOCK_SPLIT of the rank's shard of the
model comes after the units inside it: innermost first, a module becomes a unit once its tensors
outside smaller units reach ``UNIT_MIN_ELEMENTS``, and the layer keeps what is left (its norms, small
biases). Everything outside the layers is the root unit. FSDP2 shards every parameter of a unit:
``sdp_param_persistence_threshold`` keeps nothing whole on this engine (translate/mics.py MICS_KEYS).
Tensor-parallel tensors are 1/t, as the runtime sees them when it picks the units."""

from __future__ import annotations

from dataclasses import dataclass

from smp_adapter.plan.zero3 import LAYERS, TIED, default_trees
from smp_adapter.translate.mics import UNIT_MIN_ELEMENTS, splits_block


@dataclass(frozen=True)
class MicsUnits:
    root: int  # numel of the root unit: every tensor outside the layers
    layer: tuple  # numel of each unit of one layer, innermost first, the layer's own rest last

    @property
    def layer_numel(self) -> int:
        return sum(self.layer)

    @property
    def largest(self) -> int:
        return max(self.layer, default=0)


def _claim(node, sizes: list[int], taken: list[int], units: list[int], top: bool) -> int:
    """The numel of ``node``'s subtree left outside units, after appending the units found inside it.
    A node's own tensors are the next ``kind`` of ``sizes`` (pre-order, as zero3's trees assign them)."""
    kind, children = node
    free = 0
    if kind not in (LAYERS, TIED):
        free = sum(sizes[taken[0]:taken[0] + kind])
        taken[0] += kind
    free += sum(_claim(child, sizes, taken, units, False) for child in children)
    if not top and free >= UNIT_MIN_ELEMENTS:
        units.append(free)
        return 0
    return free


def mics_units(spec, dims) -> MicsUnits:
    """The units one rank's FSDP2 gathers for this spec and layout."""
    t = dims.tp
    size = lambda n, split: n // t if split and t > 1 else n  # noqa: E731
    sizes = [size(n, s) for n, s in spec.layer_tensors]
    root = sum(size(n, s) for n, s in spec.outer_tensors)
    if not splits_block(sum(sizes), spec.layers * sum(sizes) + root, dims.sdp):
        return MicsUnits(root, (sum(sizes),))
    layer_tree = getattr(spec, "layer_modules", ()) or default_trees(spec)[1]
    units: list[int] = []
    rest = _claim(layer_tree, sizes, [0], units, True)
    if rest:
        units.append(rest)
    return MicsUnits(root, tuple(units))
