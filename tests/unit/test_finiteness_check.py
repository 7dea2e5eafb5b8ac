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
