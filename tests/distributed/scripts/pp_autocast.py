"""A pipeline (pp 2) step body that wraps model(...) in torch.autocast, as the AWS MNIST example
does with torch.cuda.amp.autocast. Writes the losses and the dtype model(...) returned."""

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

AUTOCAST = os.environ.get("AUTOCAST", "1") == "1"


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


if __name__ == "__main__":
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
    model = smp.DistributedModel(net())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    dtypes = []

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
            out = model(x)
            dtypes.append(str(out.dtype))
            loss = nn.functional.mse_loss(out.float(), y)
        model.backward(loss)
        return loss

    x, y = data()
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        optimizer.step()
    write_result({"losses": losses, "dtypes": sorted(set(dtypes)), "pp_rank": smp.pp_rank()})
