"""transformers' Trainer has a SageMaker model-parallel path that calls smp directly. It needs a
GPU to run (tests/gpu), but on CPU we can check that every smp attribute it uses exists here, and
that transformers detects smp-adapter as smdistributed when launched with smp options."""

import inspect
import re

import pytest

import smdistributed.modelparallel.torch as smp


def _smp_uses():
    import transformers.modeling_utils as mu
    import transformers.trainer as tr
    import transformers.trainer_pt_utils as tpu
    import transformers.training_args as ta

    text = "\n".join(inspect.getsource(m) for m in (tr, tpu, ta, mu))
    return sorted(set(re.findall(r"\bsmp\.([A-Za-z_][A-Za-z_.]*)", text)))


def test_every_smp_attribute_transformers_uses_exists():
    uses = _smp_uses()
    assert "DistributedModel" in uses and "step" in uses
    for dotted in uses:
        obj = smp
        for part in dotted.split("."):
            if part in ("cfg",) and obj is smp.state:
                break  # smp.state.cfg needs smp.init; checked below
            obj = getattr(obj, part)


def test_state_cfg_attributes_transformers_reads():
    from smp_adapter.config.options import SMPConfig

    cfg = SMPConfig.from_dict({"partitions": 1, "ddp": True})
    for name in ("fp16", "prescaled_batch", "shard_optimizer_state"):
        assert hasattr(cfg, name)


def test_transformers_detects_smp_when_launched_with_partitions(monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"partitions": 1, "ddp": true}')
    monkeypatch.setenv("SM_FRAMEWORK_PARAMS", '{"sagemaker_mpi_enabled": true}')
    assert import_utils.is_sagemaker_mp_enabled()
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"ddp": true}')
    assert not import_utils.is_sagemaker_mp_enabled()
    pytest.importorskip("transformers")


def test_accelerate_wraps_smp_optimizers_without_the_state_round_trip(monkeypatch):
    """transformers 4.57 wraps smp's optimizer in accelerate's AcceleratedOptimizer, whose device placement
    round-trips a full optimizer state_dict (refused under optimizer-state sharding): the shim makes that
    wrapper with device_placement=False for smp optimizers only, keeping the scaler however it was passed."""
    import sys
    import types

    from smp_adapter.compat import hf_transformers
    from smp_adapter.runtime.optimizer import DistributedOptimizer

    class AcceleratedOptimizer:  # accelerate's signature: (optimizer, device_placement=True, scaler=None)
        def __init__(self, optimizer, device_placement=True, scaler=None):
            self.optimizer, self.device_placement, self.scaler = optimizer, device_placement, scaler

    monkeypatch.setitem(sys.modules, "accelerate.optimizer", types.SimpleNamespace(AcceleratedOptimizer=AcceleratedOptimizer))
    hf_transformers.no_device_placement_round_trip(DistributedOptimizer)
    hf_transformers.no_device_placement_round_trip(DistributedOptimizer)  # idempotent: wrapped once
    smp_optimizer = DistributedOptimizer.__new__(DistributedOptimizer)
    assert AcceleratedOptimizer(smp_optimizer).device_placement is False
    assert AcceleratedOptimizer(smp_optimizer, True, "scaler").scaler == "scaler"
    assert AcceleratedOptimizer(smp_optimizer, True, "scaler").device_placement is False
    assert AcceleratedOptimizer(object()).device_placement is True  # anything else: as accelerate wrote it
