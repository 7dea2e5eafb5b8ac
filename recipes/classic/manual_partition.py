"""The smp docs' manual-partitioning example (shared/seeds/003): child modules created inside
`with smp.partition(0):` / `with smp.partition(1):` go to those pipeline stages. The published
"# define child modules" placeholders are filled with small layers; MNIST is replaced by generated
digits."""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import smdistributed.modelparallel.torch as smp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnist_convnet import digits_loader, gpu_device, parse_args, train  # noqa: E402


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


args = parse_args()
smp.init()
device = gpu_device()
train_loader = digits_loader(args.samples, args.batch_size)

model = GroupedNet()
optimizer = optim.Adadelta(model.parameters(), lr=4.0)
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer)
