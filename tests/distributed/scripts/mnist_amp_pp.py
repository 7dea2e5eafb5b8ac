"""MNIST-style pipeline script with smp.amp.GradScaler, in the style of the AWS smp v1 MNIST
example: the step body scales the loss and calls model.backward on it; outside the step function
``scaler.step(optimizer)`` and ``scaler.update()`` run on every rank, including the first stage,
which never computed a loss. Data are random 1x28x28 images (no dataset download).

--overflow-at S       put an inf into the batch of step S (every stage must skip that step)
--last-stage-inf-at S  after the step function of step S, put an inf into one gradient of the last
                       stage only (an overflow that one stage alone sees: all must still skip)
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 12 * 12, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), 1)


def batch(step: int, size: int, overflow_at: int):
    g = torch.Generator().manual_seed(500 + step)
    data, target = torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)
    if step == overflow_at:
        data[0, 0, 0, 0] = float("inf")
    return data, target


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--overflow-at", type=int, default=-1)
    parser.add_argument("--last-stage-inf-at", type=int, default=-1)
    args = parser.parse_args()

    smp.init()
    torch.manual_seed(1)
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # trace_device="cpu": carried out, nothing said
        warnings.simplefilter("always")
        model = smp.DistributedModel(Net(), trace_device="cpu")
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model, scaler, data, target):
        output = model(data)
        loss = F.nll_loss(output, target, reduction="mean")
        scaled_loss = scaler.scale(loss) if scaler else loss
        model.backward(scaled_loss)
        return output, loss

    losses, scales = [], []
    model.train()
    for step in range(args.steps):
        data, target = batch(step, args.batch_size, args.overflow_at)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, scaler, data, target)
        losses.append(loss_mb.reduce_mean().item())
        if step == args.last_stage_inf_at and smp.pp_rank() == smp.pp_size() - 1:
            next(model.local_parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    state = model.state_dict()
    write_result({"losses": losses, "scales": scales, "pp_rank": smp.pp_rank(), "rank": smp.rank(),
                  "trace_warnings": [str(w.message) for w in caught if "trace_device" in str(w.message)],
                  "final_state": {k: v.tolist() for k, v in state.items()} if smp.rank() == 0 else None})


if __name__ == "__main__":
    main()
