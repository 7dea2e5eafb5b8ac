"""Pipeline-parallel misuse must fail on every rank with a message (never hang).

--case untraceable  data-dependent Python control flow in forward: torch.export cannot split it
--case order        manual partition whose stages do not run in order 0 -> 1
--case early_save   a partial checkpoint saved before the first step (the model has no stages yet)
--case compiling    not an error: a forward that reads a value only when not compiling (transformers 4.x's SDPA
                    mask check, ``torch.all(mask == 1)``) trains, its stages profiled in torch.export's state
Each rank writes {"error": type, "message": text}.
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

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="untraceable")
args, _ = parser.parse_known_args()
smp.init()


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if float(h.sum()) > 0:  # data-dependent branch
            h = h * 2
        return F.log_softmax(self.b(h), 1)


class CompilingAware(nn.Module):
    """transformers 4.x's _prepare_4d_attention_mask_for_sdpa: drops an all-ones mask, a data-dependent
    test it skips while torch.compiler.is_compiling()."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        mask = torch.ones_like(x)
        if not torch.compiler.is_compiling() and torch.all(mask == 1):
            mask = None
        h = self.a(x) if mask is None else self.a(x * mask)
        return F.log_softmax(self.b(h), 1)


class WrongOrder(nn.Module):
    def __init__(self):
        super().__init__()
        with smp.partition(1):
            self.a = nn.Linear(4, 4)
        with smp.partition(0):
            self.b = nn.Linear(4, 2)

    def forward(self, x):
        return F.log_softmax(self.b(self.a(x)), 1)


torch.manual_seed(0)
model = smp.DistributedModel({"order": WrongOrder, "compiling": CompilingAware}.get(args.case, Untraceable)())
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target)
    model.backward(loss)
    return loss


try:
    if args.case == "early_save":
        smp.save_checkpoint(os.path.join(os.environ.get("SMP_TEST_OUT", "."), "ckpt"), tag="early", partial=True)
    train_step(model, torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))
    result = {"error": None, "message": ""}
except Exception as e:  # noqa: BLE001
    result = {"error": type(e).__name__, "message": str(e)}
write_result(result)
