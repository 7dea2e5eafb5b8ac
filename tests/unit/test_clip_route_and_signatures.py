"""runtime/clipping.py's route of torch.nn.utils.clip_grad_norm_ (and get_total_norm) to the engine, and the pipeline's signature of
a call's model inputs (runtime/engines/pipeline/signature.py), without a process group."""

import pytest
import torch
from torch import nn

from smp_adapter import run_shutdown_resets
from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.runtime import clipping
from smp_adapter.runtime.engines.pipeline.signature import of_inputs, of_microbatches


class _Engine:
    """What the route asks of an engine: its model's parameters and its global-norm clip."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def clip_grad_norm(self, params, max_norm):
        self.calls.append((len(params), max_norm))
        return 7.0



def _routed():
    """A model and another module, every gradient 3, the route installed for an engine of the model."""
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    for p in [*model.parameters(), *other.parameters()]:
        p.grad = torch.full_like(p, 3.0)
    engine = _Engine(model)
    clipping.route_torch_clipping(engine)
    return model, other, engine

def test_torch_clip_on_the_model_goes_to_the_engine_and_back_after_shutdown():
    original = torch.nn.utils.clip_grad_norm_
    model, other, engine = _routed()
    try:
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)) == 7.0
        assert engine.calls == [(2, 0.5)]
        assert torch.equal(model.weight.grad, torch.full_like(model.weight, 3.0))  # the engine scales, not torch
        norm = torch.nn.utils.clip_grad.clip_grad_norm_(other.parameters(), 1.0)  # not the model's: torch's own
        assert abs(float(norm) - 54 ** 0.5) < 1e-5 and engine.calls == [(2, 0.5)]  # six gradients of 3
        with pytest.raises(UnsupportedFeatureError, match="norm_type=1"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=1)
    finally:
        run_shutdown_resets()
    assert torch.nn.utils.clip_grad_norm_ is original and torch.nn.utils.clip_grad.clip_grad_norm_ is original



def test_accelerates_total_norm_of_the_models_gradients_is_the_engines_global_norm():
    """accelerate >= 1.16 clips through torch.nn.utils.get_total_norm + clip_grads_with_norm_ (no clip_grad_norm_):
    the norm of the model's gradients is the engine's global one (asked with max_norm inf: nothing scaled by it),
    other tensors' norm is torch's; shutdown restores torch's function."""
    original = torch.nn.utils.get_total_norm
    model, other, engine = _routed()
    try:
        from torch.nn.utils import get_total_norm  # as accelerate imports it, at each call

        assert float(get_total_norm([p.grad for p in model.parameters()])) == 7.0
        assert engine.calls == [(2, float("inf"))]
        assert torch.equal(model.weight.grad, torch.full_like(model.weight, 3.0))
        assert abs(float(get_total_norm([p.grad for p in other.parameters()])) - 54 ** 0.5) < 1e-5
        with pytest.raises(UnsupportedFeatureError, match="norm_type=1"):
            get_total_norm([p.grad for p in model.parameters()], norm_type=1)
    finally:
        run_shutdown_resets()
    assert torch.nn.utils.get_total_norm is original

def test_signature_counts_what_a_trace_depends_on_and_not_keyword_order():
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    base = of_inputs((), {"input_ids": x, "labels": y}, True)
    assert of_inputs((), {"labels": y, "input_ids": x}, True) == base
    assert of_inputs((), {"input_ids": x}, True) != base  # labels left out (Trainer.predict)
    assert of_inputs((), {"input_ids": torch.zeros(2, 3), "labels": y[:2]}, True) != base  # the last smaller batch
    assert of_inputs((), {"input_ids": x, "labels": y}, False) != base  # eval mode
    assert of_inputs((), {"input_ids": x, "labels": y, "return_dict": False}, True) != \
        of_inputs((), {"input_ids": x, "labels": y, "return_dict": True}, True)
    # an object is taken by its type: its repr (often with its address) would make every call new
    assert of_inputs((object(),), {}, True) == of_inputs((object(),), {}, True)


def test_microbatches_of_one_step_must_agree():
    module = nn.Linear(3, 3)
    same = [((torch.zeros(2, 3),), {}), ((torch.ones(2, 3),), {})]
    assert of_microbatches(same, module) == of_inputs((torch.zeros(2, 3),), {}, True)
    assert of_microbatches([((torch.zeros(2, 3),), {}), ((torch.zeros(1, 3),), {})], module) == "mixed"
