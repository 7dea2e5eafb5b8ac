"""The smp docs' tensor-parallelism-alone example (shared/seeds/000), with MNIST replaced by
generated 28x28 images (no network): the conv + linear net is created inside
smp.tensor_parallelism(), so both nn.Linear layers are split over the TP ranks, and it trains
in plain PyTorch style (model(x), loss.backward(), optimizer.step())."""

import sys
from pathlib import Path

import torch.optim as optim

import smdistributed.modelparallel.torch as smp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnist_convnet import Net, digits_loader, gpu_device, parse_args, train  # noqa: E402

args = parse_args()
smp.init()
device = gpu_device()
train_loader = digits_loader(args.samples, args.batch_size)

with smp.tensor_parallelism():
    model = Net()
model = smp.DistributedModel(model)
optimizer = optim.Adadelta(model.parameters(), lr=4.0)  # the original's optim.AdaDelta is a typo
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer, pipelined=False)
