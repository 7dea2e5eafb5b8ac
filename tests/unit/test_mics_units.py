"""MiCS's sharding units for any model (runtime/engines/mics/units.py sharding_units): every submodule
whose parameters outside smaller units reach UNIT_MIN_ELEMENTS, innermost first; a model's repeated
blocks are units whatever their size, after the units inside them; tied weights stay with the root.
plan (plan/mics_units.py) counts the same units from the model's spec."""

import pytest
import torch
from torch import nn

from smp_adapter.runtime.engines.mics.units import UNIT_MIN_ELEMENTS, sharding_units
from smp_adapter.runtime.kernel_switches import repeated_blocks


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


def test_a_wide_block_shards_its_projections_one_at_a_time():
    """Inside a repeated block the size rule applies too: children of >= UNIT_MIN_ELEMENTS come first,
    the block keeps the rest (RESULTS.md §20.1: GPT-2 of width 1024 peaked at 0.95 x plain PyTorch's run
    with a unit per block, 0.74 x with its projections as units)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(1024)
            self.up = nn.Linear(1024, 2048)  # 2.1M elements: a unit
            self.mix = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024))  # 0.52M each: their parent is one
            self.down = nn.Linear(2048, 1024)

    with torch.device("meta"):
        model = nn.Module()
        model.layers = nn.ModuleList([Block() for _ in range(2)])
    first, second = model.layers
    assert sharding_units(model) == [first.up, first.mix, first.down, first, second.up, second.mix, second.down, second]


def _runtime_layer_units(model, units):
    """numel each unit of the first block shards (its parameters outside the units before it)."""
    claimed, sizes = set(), []
    for unit in units:
        free = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in free)
        sizes.append(sum(p.numel() for p in free))
    blocks = set(map(id, repeated_blocks(model)))
    first_block = next(i for i, u in enumerate(units) if id(u) in blocks)
    return sizes[:first_block + 1], sum(sizes)


WIDE = {  # width 1024: each projection reaches UNIT_MIN_ELEMENTS (GPT-2's c_proj by its bias: 1,049,600)
    "gpt2": ({"model_type": "gpt2", "vocab_size": 8192, "n_embd": 1024, "n_layer": 2, "n_head": 16, "n_positions": 64},
             "GPT2LMHeadModel", "GPT2Config"),
    "llama": ({"model_type": "llama", "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 2,
               "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816}, "LlamaForCausalLM",
              "LlamaConfig"),
    "vit": ({"model_type": "vit", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
             "intermediate_size": 4096, "image_size": 64, "patch_size": 16}, "ViTForImageClassification", "ViTConfig"),
    "gpt_neox": ({"model_type": "gpt_neox", "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 2,
                  "num_attention_heads": 16, "intermediate_size": 4096, "max_position_embeddings": 64},
                 "GPTNeoXForCausalLM", "GPTNeoXConfig"),
    # seed 002's ViT (50 layers, 632M parameters): at sdp 4 a layer is 1/12 of a rank's shard, one unit each
    "vit_002": ({"model_type": "vit", "hidden_size": 1024, "num_hidden_layers": 50, "num_attention_heads": 16,
                 "intermediate_size": 4096, "image_size": 256, "patch_size": 16, "num_labels": 1000},
                "ViTForImageClassification", "ViTConfig"),
}
SPLIT = {"vit_002": False}  # the others: 2 layers, each above 1/BLOCK_SPLIT of a rank's shard at sdp 2


@pytest.mark.parametrize("family", sorted(WIDE))
def test_plan_counts_the_units_the_engine_shards(family):
    """plan/mics_units.py reads the units from the model's spec; the engine picks them from the module
    tree transformers builds: the same number of units per layer, each of the same size within its
    bias (a spec without a module tree has weight and bias as separate leaves, and the bias stays with
    the layer there: 1e-3 relative), and the same root (everything outside the layers). A layer is
    split into its projections only where it holds more than 1/BLOCK_SPLIT of a rank's shard."""
    transformers = pytest.importorskip("transformers")
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.plan.mics_units import mics_units
    from smp_adapter.plan.model_spec import model_spec

    cfg, model_name, config_name = WIDE[family]
    with torch.device("meta"):
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(
            **{k: v for k, v in cfg.items() if k != "model_type"}))
    split = SPLIT.get(family, True)
    sdp = 2 if split else 4
    engine_layer, total = _runtime_layer_units(model, sharding_units(model, sdp))
    dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": sdp}), 2 * sdp)
    planned = mics_units(model_spec(cfg, seq_len=64), dims)
    assert len(planned.layer) == len(engine_layer)
    assert (len(engine_layer) > 2) is split
    assert sorted(planned.layer[:-1]) == pytest.approx(sorted(engine_layer[:-1]), rel=1e-3)
    assert planned.layer_numel == sum(engine_layer)
    assert planned.root == sum(p.numel() for p in model.parameters()) - total
