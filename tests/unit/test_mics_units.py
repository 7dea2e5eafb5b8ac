"""MiCS's sharding units for any model (runtime/engines/mics/mesh.py sharding_units): a model's
repeated blocks when it has them; otherwise every submodule whose parameters outside smaller units
reach UNIT_MIN_ELEMENTS, innermost first; tied weights stay with the root."""

import torch
from torch import nn

from smp_adapter.runtime.engines.mics.mesh import UNIT_MIN_ELEMENTS, sharding_units


def test_a_sequential_of_large_layers_is_a_unit_per_layer():
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.Tanh())])
    assert sharding_units(model) == [model[0], model[2], model[4], model[6]]


def test_small_layers_are_grouped_by_their_parent_and_tiny_models_stay_one_unit():
    width = 512  # 0.26M elements a layer: four make a unit
    with torch.device("meta"):
        blocks = [nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]) for _ in range(3)]
        model = nn.Sequential(*blocks, nn.Linear(width, 2))
        tiny = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert 4 * (width * width + width) >= UNIT_MIN_ELEMENTS > width * width + width
    assert sharding_units(model) == blocks
    assert sharding_units(tiny) == []  # the root alone, as before


def test_tied_weights_stay_with_the_root_and_blocks_come_first():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(4096, 512)
            self.body = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 0.52M elements each
            self.head = nn.Linear(512, 4096, bias=False)
            self.head.weight = self.embed.weight

    with torch.device("meta"):
        tied = Tied()
        blocks = nn.Module()
        blocks.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
    assert sharding_units(tied) == [tied.body]  # embed and head share their weight: the root's
    assert sharding_units(blocks) == list(blocks.layers)  # repeated blocks, whatever their size
