"""fp16 with smp's dynamic loss scaling on one GPU: the model is created inside smp.model_creation
(dtype=float16) as smp v1 asks, DistributedOptimizer gets the loss-scale arguments."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

smp.init()
torch.cuda.set_device(smp.local_rank())
torch.manual_seed(0)
with smp.model_creation(dtype=torch.float16):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None,
                                     dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 10,
                                                                                 "init_scale": 2**10})


@smp.step
def train_step(model, x, y):
    loss = F.cross_entropy(model(x).float(), y)
    model.backward(loss)
    return loss


g = torch.Generator().manual_seed(1)
x = torch.randn(64, 32, generator=g).cuda()
y = (x[:, :4].argmax(1)).cuda()
losses = []
for _ in range(30):
    optimizer.zero_grad()
    losses.append(train_step(model, x, y).reduce_mean().item())
    optimizer.step()
write_result({"losses": losses, "dtype": str(next(model.parameters()).dtype)})
