import torch
import torch.nn as nn
import torch.nn.functional as F
import smdistributed.modelparallel.torch as smp

smp.init()  # the smp options come from the launcher, as on SageMaker
torch.cuda.set_device(smp.local_rank())
device = torch.device("cuda")
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
model = smp.DistributedModel(model)  # pipeline_parallel_degree 2: each rank holds its stage
optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))


@smp.step  # the batch is split into `microbatches` and pipelined
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


g = torch.Generator().manual_seed(smp.dp_rank())
for step in range(20):
    data = torch.randn(32, 32, generator=g)
    target = data[:, :4].argmax(1)
    optimizer.zero_grad()
    loss = train_step(model, data.to(device), target.to(device)).reduce_mean()
    optimizer.step()
    if smp.rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
