"""The smp docs' manual-partitioning example (shared/seeds/003): child modules created inside
`with smp.partition(0):` / `with smp.partition(1):` go to those pipeline stages. The published
"# define child modules" placeholders are filled with small layers; MNIST is replaced by generated
digits."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import smdistributed.modelparallel.torch as smp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import recipe_utils as ru  # noqa: E402


class GroupedNet(nn.Module):
    def __init__(self):
        super(GroupedNet, self).__init__()
        with smp.partition(0):
            self.conv = nn.Conv2d(1, 8, 3, 1)
            self.hidden = nn.Linear(8 * 26 * 26, 64)
        with smp.partition(1):
            self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = F.relu(self.hidden(torch.flatten(x, 1)))
        return F.log_softmax(self.fc(x), 1)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model, device, train_loader, optimizer):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        if smp.rank() == 0:
            print(f"batch {batch_idx}: loss {loss.item():.4f}", flush=True)


parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=512)
args, _ = parser.parse_known_args()

smp.init()
# the seed's GPU setup, unchanged: on CPU ranks smp-adapter launch runs it on the CPU (docs/launch.md §7)
torch.cuda.set_device(smp.local_rank())
device = torch.device("cuda")
dataset = ru.digits(args.samples)
if smp.dp_size() > 1:
    dataset = torch.utils.data.Subset(dataset, range(smp.dp_rank(), len(dataset), smp.dp_size()))
train_loader = torch.utils.data.DataLoader(dataset, batch_size=32, drop_last=True)

model = GroupedNet()
optimizer = optim.Adadelta(model.parameters(), lr=4.0)
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer)
