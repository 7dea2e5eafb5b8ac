"""The one-time finiteness checks (runtime/finiteness.py): NaN/inf weights right after
smp.DistributedModel, or a non-finite first loss, stop the job with the first offending tensor named,
instead of training on NaN to exit status 0; a finite model trains unchanged."""

import pytest
import torch
from torch import nn

import smdistributed.modelparallel.torch as smp
from smp_adapter.errors import SMPUsageError


class _Rotary(nn.Module):
    """A model with a non-persistent table filled at init, as GPT-J's rotary embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.ones(4), persistent=False)

    def forward(self, x):
        return (self.proj(x) * self.table).sum()


@pytest.mark.parametrize("which, bad", [("buffer table", float("nan")), ("parameter proj.bias", float("inf"))])
def test_non_finite_weights_after_distributed_model_are_named(fresh, which, bad):
    smp.init({})
    model = _Rotary()
    (model.table if which.startswith("buffer") else model.proj.bias).data[2] = bad
    with pytest.raises(SMPUsageError, match=rf"non-finite values \(NaN/inf\) right after smp.DistributedModel: first "
                                            rf"{which} on rank 0\. Training it would give NaN losses; an initialisation "
                                            r"path left it unset.*do not disable PreTrainedModel.init_weights"):
        smp.DistributedModel(model)


def test_non_finite_first_loss_is_refused_once_and_finite_losses_train(fresh):
    smp.init({})
    model = smp.DistributedModel(_Rotary())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(x):
        loss = model(x)
        model.backward(loss)
        return loss

    with pytest.raises(SMPUsageError, match=r"the first loss is not finite \(nan\) on rank 0.*labels all ignored"):
        step(torch.full((2, 4), float("nan")))
    losses = []
    for _ in range(2):  # checked once only: later steps run whatever their loss
        optimizer.zero_grad()
        losses.append(step(torch.ones(2, 4)).reduce_mean().item())
        optimizer.step()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


# -- every step (runtime/finiteness.StepGuard) ---------------------------------------------------------------------
from smp_adapter.runtime.finiteness import NonFinitePolicy, policy_from_env  # noqa: E402


def _job(fresh_policy: dict, monkeypatch):
    for key, value in fresh_policy.items():
        monkeypatch.setenv(key, value)
    smp.init({})
    model = smp.DistributedModel(_Rotary())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(x):
        loss = model(x)
        model.backward(loss)
        return loss

    def train(x):
        optimizer.zero_grad()
        loss = step(x).reduce_mean().item()
        optimizer.step()
        return loss

    return model, train


def test_policy_comes_from_the_environment_and_bad_values_name_the_fix():
    assert policy_from_env({}) == NonFinitePolicy("stop", 10)
    assert policy_from_env({"SMP_ADAPTER_NON_FINITE": "Skip", "SMP_ADAPTER_MAX_SKIPPED_STEPS": "3"}) == \
        NonFinitePolicy("skip", 3)
    with pytest.raises(SMPUsageError, match=r"SMP_ADAPTER_NON_FINITE='ignore': must be one of stop, skip, off"):
        policy_from_env({"SMP_ADAPTER_NON_FINITE": "ignore"})
    with pytest.raises(SMPUsageError, match=r"SMP_ADAPTER_MAX_SKIPPED_STEPS='0': must be a positive integer"):
        policy_from_env({"SMP_ADAPTER_MAX_SKIPPED_STEPS": "0"})


def test_a_nan_loss_after_the_first_step_stops_at_that_step(fresh, monkeypatch):
    model, train = _job({}, monkeypatch)
    train(torch.ones(2, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SMPUsageError, match=r"optimizer step 2 \(call 2 of optimizer.step\(\)\): the loss given to "
                                            r"model.backward is not finite \(nan\) on rank 0\. The job stops"):
        train(torch.full((2, 4), float("nan")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no NaN update


def test_skip_policy_keeps_the_weights_and_stops_after_n_skips_in_a_row(fresh, monkeypatch, capsys):
    model, train = _job({"SMP_ADAPTER_NON_FINITE": "skip", "SMP_ADAPTER_MAX_SKIPPED_STEPS": "2"}, monkeypatch)
    train(torch.ones(2, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(torch.full((2, 4), float("nan")))  # skipped: no update, a warning
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "optimizer step 2: the loss given to model.backward is not finite (nan) on rank 0; the update was " \
           "skipped (1 in a row, the job stops at 2)" in capsys.readouterr().err
    train(torch.ones(2, 4))  # a finite step resets the count
    train(torch.full((2, 4), float("nan")))
    with pytest.raises(SMPUsageError, match=r"2 optimizer steps in a row were skipped as non-finite, the last at "
                                            r"step 5"):
        train(torch.full((2, 4), float("inf")))


def test_off_policy_trains_on_as_before(fresh, monkeypatch):
    model, train = _job({"SMP_ADAPTER_NON_FINITE": "off"}, monkeypatch)
    train(torch.ones(2, 4))
    train(torch.full((2, 4), float("nan")))
    assert not torch.isfinite(model.module.proj.weight).all()
