"""Pipeline calls with other model inputs than the first step's, and torch's clip_grad_norm_ on the pipeline.

A Hugging Face-style model (the loss inside forward when a target is given), at pp 2: three training steps with
the target, each clipped with ``torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)`` (a norm that clips),
then, in eval mode, a prediction without the target (another signature), one on a batch of another size (other
shapes), the first prediction again (its stages reused), then a training step again. Each rank writes the
losses, the returned norms, the predictions, how many sets of stages were traced and whether every stage holds
the model's own parameter objects; the test compares them with one process (test_pipeline.py).
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402


class WithTarget(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x, target=None):
        out = F.log_softmax(self.b(torch.tanh(self.a(x))), 1)
        return out if target is None else F.nll_loss(out, target)


def data():
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]
    return train, torch.randn(4, 4, generator=g), torch.randn(6, 4, generator=g)


def main():
    smp.init()
    torch.manual_seed(0)
    model = smp.DistributedModel(WithTarget())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def loss_step(model, x, target):
        loss = model(x, target=target)
        model.backward(loss)
        return loss

    @smp.step
    def predict_step(model, x):
        return model(x)

    def train(x, target):
        optimizer.zero_grad()
        loss = loss_step(model, x, target).reduce_mean()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
        return float(loss), float(norm)

    train_data, first, other = data()
    steps = [train(x, t) for x, t in train_data[:3]]
    model.eval()
    with torch.no_grad():
        predicted = [torch.cat(predict_step(model, x).outputs).tolist() for x in (first, other, first)]
    model.train()
    steps.append(train(*train_data[3]))
    runner = model.runtime_engine.runner
    own = {id(p) for p in model.parameters()}
    shared = all(id(p) in own for s in runner._signatures for m in s.built.stage_modules for p in m.parameters())
    write_result({"losses": [s[0] for s in steps], "norms": [s[1] for s in steps], "predicted": predicted,
                  "signatures": len(runner._signatures), "shared": shared})


if __name__ == "__main__":
    main()
