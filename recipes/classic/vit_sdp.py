"""The sharded-data-parallel ViT example of the smp docs (shared/seeds/002), at a tiny size:
a ViT built from its config class, delayed parameter initialisation, activation checkpointing on
every encoder layer, @smp.step with model.backward. Data: random images (as the original's
FakeDataset). Options: sharded_data_parallel_degree = world (ZeRO) or smaller (MiCS-style hpZ)."""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import ViTConfig, ViTForImageClassification

import smdistributed.modelparallel.torch as smp


class FakeDataset(Dataset):
    def __init__(self, size, image_size, num_labels):
        self.size, self.image_size, self.num_labels = size, image_size, num_labels

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return torch.randn([3, self.image_size, self.image_size], generator=g), torch.tensor(index % self.num_labels)


parser = argparse.ArgumentParser()
parser.add_argument("--image_size", type=int, default=32)
parser.add_argument("--hidden_size", type=int, default=64)
parser.add_argument("--num_hidden_layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch_size", type=int, default=4)
args, _ = parser.parse_known_args()

smp.init()
# the seed's GPU setup, unchanged: on CPU ranks smp-adapter launch runs it on the CPU (docs/launch.md §7)
torch.cuda.set_device(smp.local_rank())
device = torch.device("cuda")
config = ViTConfig(image_size=args.image_size, patch_size=8, hidden_size=args.hidden_size,
                   num_hidden_layers=args.num_hidden_layers, num_attention_heads=4,
                   intermediate_size=4 * args.hidden_size, num_labels=10)
with smp.delay_param_initialization(enabled=smp.state.cfg.delayed_parameter_initialization):
    model = ViTForImageClassification(config)
model = smp.DistributedModel(model)
vit = model.get_module().vit
for layer in (vit.layers if hasattr(vit, "layers") else vit.encoder.layer):  # transformers 5 renamed it
    smp.set_activation_checkpointing(layer)
optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
loss_function = torch.nn.CrossEntropyLoss()
dataset = FakeDataset(args.steps * args.batch_size * smp.dp_size(), args.image_size, 10)
sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=False)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


@smp.step
def train_step(model, inputs, targets):
    outputs = model(inputs)
    loss = loss_function(outputs["logits"], targets)
    model.backward(loss)
    return loss


model.train()
t0 = time.perf_counter()
for idx, (inputs, targets) in enumerate(loader, start=1):
    inputs, targets = inputs.to(device), targets.to(device)
    optimizer.zero_grad()
    loss = train_step(model, inputs, targets).reduce_mean()
    optimizer.step()
    if smp.rank() == 0:
        print(f"step {idx}: loss {loss.item():.4f} step time {time.perf_counter() - t0:.3f}s", flush=True)
    t0 = time.perf_counter()
