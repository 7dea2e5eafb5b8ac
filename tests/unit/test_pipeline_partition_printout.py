"""runtime/engines/pipeline/partition.py: the "Partition assignments" lines rank 0 prints name each unit by
its path from the model given to smp.DistributedModel (an nn.Sequential's layers as model.0, model.2, not a
bare 0 that reads as a stage), with the stage, and the rank holding it when a rank holds several stages."""

import torch
from torch import nn

from smp_adapter.runtime.engines.pipeline import partition
from smp_adapter.runtime.engines.pipeline.virtual_stages import StageLayout


def _readme_model() -> nn.Module:
    """examples/smp_v1_train.py's model."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def test_the_readme_models_stages_are_printed_by_module_path():
    model = _readme_model()
    stages = partition.auto_split(model, partition.profile(model, (torch.zeros(8, 32),), {}), 2, 0.8)
    text = partition.assignment_text(stages, "auto")
    lines = text.splitlines()
    assert lines[0] == "Partition assignments (auto, 2 stages; model is the module given to smp.DistributedModel):"
    # one line per unit, in stage order, each the path the printed unit is reached by from the model
    expected = [f"  model.{unit} -> {i}" for i, units in enumerate(stages) for unit in units]
    assert lines[1:] == expected
    named = dict(model.named_modules())
    assert all(isinstance(named[unit], nn.Linear) for units in stages for unit in units)
    assert sorted(unit for units in stages for unit in units) == ["0", "2", "4"]  # the ReLUs own no parameters


def test_nested_paths_and_the_rank_of_each_stage():
    stages = [["transformer.wte", "transformer.h.0"], ["transformer.h.1"], ["transformer.h.2"],
              ["transformer.ln_f", "lm_head"]]
    looped = StageLayout(pp=2, v=2, v_shaped=False)  # rank r holds stages r and r + 2
    assert partition.assignment_text(stages, "manual", looped).splitlines() == [
        "Partition assignments (manual, 4 stages, 2 per rank; model is the module given to smp.DistributedModel):",
        "  model.transformer.wte -> 0 (rank 0)",
        "  model.transformer.h.0 -> 0 (rank 0)",
        "  model.transformer.h.1 -> 1 (rank 1)",
        "  model.transformer.h.2 -> 2 (rank 0)",
        "  model.transformer.ln_f -> 3 (rank 1)",
        "  model.lm_head -> 3 (rank 1)",
    ]


def test_every_printed_path_reaches_its_module():
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.h = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    stages = [["transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3"]]
    for line in partition.assignment_text(stages, "manual").splitlines()[1:]:
        path, _, stage = line.strip().partition(" -> ")
        root, _, rest = path.partition(".")
        assert root == "model"
        assert model.get_submodule(rest) is model.transformer.h[int(rest.rsplit(".", 1)[1])]
        assert rest in stages[int(stage)]
