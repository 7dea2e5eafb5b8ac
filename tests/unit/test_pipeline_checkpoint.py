"""Checks behind partial checkpoints with pipeline_parallel_degree > 1 (smp_adapter/runtime/engines/pipeline/checkpoint.py)
that need no process group: a checkpoint from another stage assignment, or with entries of another
model or stage, is refused with a message that says why and what to do."""

from types import SimpleNamespace

import pytest
import torch

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.engines.pipeline.checkpoint import STAGE_MARK, _check_stage, load_stage_state_dict

UNITS = [["layers.0", "layers.1"], ["layers.2", "head"]]


def runner(units=UNITS, local_keys=("layers.0.weight", "layers.0.bias")):
    return SimpleNamespace(built=True, stage_units=units, local_keys=set(local_keys))


def test_same_stage_assignment_and_entries_pass():
    _check_stage(runner(), [list(u) for u in UNITS], {"layers.0.weight", "layers.0.bias"}, strict=True)


def test_another_stage_assignment_is_refused():
    saved = [["layers.0"], ["layers.1", "layers.2", "head"]]
    with pytest.raises(SMPCheckpointError, match=r"saved under another stage assignment \(saved layers\.0 \| "
                                                 r"layers\.1,layers\.2,\.\.\., now layers\.0,layers\.1 \| layers\.2,head\)"
                                                 r".*same partition.*smp-adapter checkpoint reshard DIR --to OPTIONS --world-size N OUT` and "
                                                 r"resume OUT \(its layout-independent pieces load into any partition\)"
                                                 r".*partial=False"):
        _check_stage(runner(), saved, {"layers.0.weight", "layers.0.bias"}, strict=True)


def test_missing_entries_of_this_stage_are_refused_unless_not_strict():
    with pytest.raises(SMPCheckpointError, match=r"lacks entries of this stage: \['layers\.0\.bias'\].*strict=False"):
        _check_stage(runner(), None, {"layers.0.weight"}, strict=True)
    _check_stage(runner(), None, {"layers.0.weight"}, strict=False)


def test_non_persistent_buffers_of_a_stage_are_not_missing():
    """A stage's state dict lists the model's non-persistent buffers too (torch.export registers every
    buffer of a stage as persistent; transformers 4.x's GPT-2 attn.bias): a partial checkpoint never
    holds them, and resuming must not call them missing (the lowest matrix point's GPT-2 resume failed so)."""
    stage = runner(local_keys=("layers.0.weight", "layers.0.mask"))
    _check_stage(stage, None, {"layers.0.weight"}, strict=True, persistent={"layers.0.weight", "layers.1.weight"})
    with pytest.raises(SMPCheckpointError, match=r"lacks entries of this stage: \['layers\.0\.weight'\]"):
        _check_stage(stage, None, set(), strict=True, persistent={"layers.0.weight", "layers.1.weight"})


def _model():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    local = {"0.weight", "0.bias"}
    # a built PipelineRunner's surface: the model, its stage assignment, this stage's keys
    return SimpleNamespace(module=module, built=True, stage_units=[["0"], ["1"]], local_keys=local,
                           on_partitioned=lambda check: check())


def test_entries_of_another_model_are_refused_and_nothing_is_loaded():
    model = _model()
    before = model.module[0].weight.detach().clone()
    sd = {"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2), "encoder.weight": torch.ones(2, 2),
          STAGE_MARK: [["0"], ["1"]]}
    with pytest.raises(SMPCheckpointError, match=r"entries this model does not have: \['encoder\.weight'\].*strict=False"):
        load_stage_state_dict(model, dict(sd))
    assert torch.equal(model.module[0].weight, before)  # nothing changed


def test_this_stages_entries_load_and_other_stages_keep_their_values():
    model = _model()
    other = model.module[1].weight.detach().clone()
    load_stage_state_dict(model, {"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2), STAGE_MARK: [["0"], ["1"]]})
    assert torch.equal(model.module[0].weight, torch.ones(2, 2))
    assert torch.equal(model.module[1].weight, other)


def test_optimizer_state_owners_balance_by_size():
    from smp_adapter.runtime.engines.pipeline.sharded_optimizer import assign_owners

    # largest first to the least-loaded rank, ties to the lower rank
    assert assign_owners([256, 16, 256, 16, 256, 16], 2) == [0, 1, 1, 1, 0, 1]
    sizes = [1000, 10, 999, 3, 500, 500, 7]
    owners = assign_owners(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes)
    assert assign_owners([5, 5], 1) == [0, 0]
