"""The smp docs' tensor + pipeline parallelism example (shared/seeds/000, second script): the conv +
linear net, smp.set_tensor_parallelism(model.fc1, True), an @smp.step function with
model.backward, microbatches from the options. MNIST is replaced by generated digits."""

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


class Net(nn.Module):
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
parser.add_argument("--batch_size", type=int, default=32)
args, _ = parser.parse_known_args()

smp.init()
# the seed's GPU setup, unchanged: on CPU ranks smp-adapter launch runs it on the CPU (docs/launch.md §7)
torch.cuda.set_device(smp.local_rank())
device = torch.device("cuda")
dataset = ru.digits(args.samples)
if smp.dp_size() > 1:
    dataset = torch.utils.data.Subset(dataset, range(smp.dp_rank(), len(dataset), smp.dp_size()))
train_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, drop_last=True)

model = Net()
smp.set_tensor_parallelism(model.fc1, True)
model = smp.DistributedModel(model)
optimizer = optim.Adadelta(model.parameters(), lr=4.0)  # the original's optim.AdaDelta is a typo
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer)
