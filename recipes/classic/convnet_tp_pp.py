"""The smp docs' tensor + pipeline parallelism example (shared/seeds/000, second script): the conv +
linear net, smp.set_tensor_parallelism(model.fc1, True), an @smp.step function with
model.backward, microbatches from the options. MNIST is replaced by generated digits."""

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

model = Net()
smp.set_tensor_parallelism(model.fc1, True)
model = smp.DistributedModel(model)
optimizer = optim.Adadelta(model.parameters(), lr=4.0)  # the original's optim.AdaDelta is a typo
optimizer = smp.DistributedOptimizer(optimizer)
train(model, device, train_loader, optimizer)
