"""What the smp docs' MNIST examples (shared/seeds/000 and 003) have in common, kept once for the
classic recipes: the docs' conv net, their training loops (plain backward, or an @smp.step function
with model.backward), and generated digits in place of the MNIST download. Each recipe script keeps
the lines that differ between the examples: how the model is marked and wrapped."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import recipe_utils as ru  # noqa: E402


class Net(nn.Module):
    """The docs' network: two convolutions and two linear layers (fc1 is the one they split)."""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        return F.log_softmax(x, 1)


def parse_args(batch_size: int = 32):
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=batch_size)
    args, _ = parser.parse_known_args()
    return args


def digits_loader(samples: int, batch_size: int):
    """Generated stand-in for MNIST (no download), sharded by data-parallel rank as the originals do
    with SplitDataset."""
    dataset = ru.digits(samples)
    if smp.dp_size() > 1:
        dataset = torch.utils.data.Subset(dataset, range(smp.dp_rank(), len(dataset), smp.dp_size()))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, drop_last=True)


def gpu_device():
    """The seed's GPU setup, unchanged: on CPU ranks smp-adapter launch runs it on the CPU
    (docs/launch.md §7)."""
    torch.cuda.set_device(smp.local_rank())
    return torch.device("cuda")


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer, pipelined: bool = True):
    """One epoch. ``pipelined``: through ``train_step`` (microbatches, model.backward), as the pipeline
    examples do; else a plain forward and loss.backward(), as the tensor-parallel-only example does."""
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        if pipelined:
            _, loss_mb = train_step(model, data, target)
            loss = loss_mb.reduce_mean()
        else:
            loss = F.nll_loss(model(data), target, reduction="mean")
            loss.backward()
        optimizer.step()
        if smp.rank() == 0:
            print(f"batch {batch_idx}: loss {loss.item():.4f}", flush=True)
