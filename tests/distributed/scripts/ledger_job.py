"""A tiny GPT-2 trained under any layout with the communication ledger on, and beside it an
independent count of the same traffic: this script wraps torch.distributed's functions itself (its
own table of payload rules, its own wrappers), before smp.init installs the ledger, and counts per
training step (from the step call to the end of optimizer.step, the ledger's step). It also records
the peak of live CPU tensor bytes of the second step (live_tensor_bytes.py), for the plan checks.

Options come from SM_HP_MP_PARAMETERS; the model from --config (a GPT2Config JSON file)."""

import argparse
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402


def _nbytes(x):
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


# name -> (op, payload from the call's arguments, group from the call's arguments)
def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


RULES = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda a, k: _arg(a, k, 2, "group")),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda a, k: _arg(a, k, 2, "group")),
    "reduce": ("reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), lambda a, k: _arg(a, k, 3, "group")),
    "all_gather": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "tensor_list")), lambda a, k: _arg(a, k, 2, "group")),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
                               lambda a, k: _arg(a, k, 2, "group")),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
                          lambda a, k: _arg(a, k, 2, "group")),
    "_all_gather_base": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
                         lambda a, k: _arg(a, k, 2, "group")),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input_list")), lambda a, k: _arg(a, k, 3, "group")),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input")), lambda a, k: _arg(a, k, 3, "group")),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input")), lambda a, k: _arg(a, k, 3, "group")),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input")), lambda a, k: _arg(a, k, 3, "group")),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input")), lambda a, k: _arg(a, k, 4, "group")),
    "all_to_all": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor_list")), lambda a, k: _arg(a, k, 2, "group")),
    "isend": ("send", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), None),
    "send": ("send", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), None),
    "irecv": ("recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), None),
    "recv": ("recv", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), None),
}


class Count:
    def __init__(self):
        self.on, self.totals, self.busy = False, {}, threading.local()

    def add(self, op, nbytes):
        calls, total = self.totals.get(op, (0, 0))
        self.totals[op] = (calls + 1, total + nbytes)

    def take(self):
        out, self.totals = self.totals, {}
        return out


count = Count()


def wrap(name, original):
    op, payload, _ = RULES[name]

    def wrapper(*args, **kwargs):
        outer = not getattr(count.busy, "v", False)
        if outer and count.on:
            count.add(op, payload(args, kwargs))
        count.busy.v = True
        try:
            return original(*args, **kwargs)
        finally:
            count.busy.v = not outer

    wrapper.__name__ = original.__name__
    return wrapper


def wrap_batch(original):
    def wrapper(ops):
        outer = not getattr(count.busy, "v", False)
        if outer and count.on:
            for o in ops:
                count.add("send" if "send" in o.op.__name__ else "recv", _nbytes(o.tensor))
        count.busy.v = True
        try:
            return original(ops)
        finally:
            count.busy.v = not outer

    return wrapper


for _name in RULES:
    _w = wrap(_name, getattr(c10d, _name))
    setattr(c10d, _name, _w)
    setattr(dist, _name, _w)
_wb = wrap_batch(c10d.batch_isend_irecv)
c10d.batch_isend_irecv = dist.batch_isend_irecv = _wb

import smdistributed.modelparallel.torch as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--config", help="GPT2Config JSON")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--per-rank-batch", type=int, default=4)
parser.add_argument("--seq-len", type=int, default=16)
parser.add_argument("--checkpoint-activations", action="store_true")
parser.add_argument("--checkpoint-activations-from", type=int, default=None,
                    help="turn activation checkpointing on before this step (pp = 1: the engine runs the module's "
                         "forward each step; the pipeline engine applies it when it cuts the stages, at the first)")
parser.add_argument("--track-memory", default="", metavar="STEPS",
                    help="measure the peak of live tensor bytes in these steps (comma-separated; after the first: "
                         "steady state, Adam's state and the engines' buffers exist)")
args, _ = parser.parse_known_args()

smp.init()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.manual_seed(5)
config = GPT2Config(**json.loads(open(args.config).read()))
if smp.tp_size() > 1:
    with smp.tensor_parallelism():
        model = GPT2LMHeadModel(config)
else:
    with smp.model_creation():
        model = GPT2LMHeadModel(config)
model = smp.DistributedModel(model)


def checkpoint_activations():
    for block in model.get_module().transformer.h:
        smp.set_activation_checkpointing(block)


if args.checkpoint_activations:
    checkpoint_activations()
optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))


@smp.step
def train_step(model, ids):
    logits = model(input_ids=ids, use_cache=False)["logits"]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    model.backward(loss)
    return loss


from live_tensor_bytes import LiveTensorBytes  # noqa: E402

per_step = []
peaks, live_between_steps = {}, {}
model.train()
for step in range(args.steps):
    if step == args.checkpoint_activations_from:
        checkpoint_activations()
    tracked = str(step) in args.track_memory.split(",")  # the tracker costs ~1 s a step here
    if tracked:
        memory = LiveTensorBytes()
        memory.start()
        live_between_steps[step] = memory.now
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, config.vocab_size, (args.per_rank_batch, args.seq_len), generator=g)
    optimizer.zero_grad()
    count.on = True
    train_step(model, ids)
    optimizer.step()
    count.on = False
    if tracked:
        memory.stop()
        peaks[step] = memory.peak
    per_step.append({op: list(v) for op, v in count.take().items()})
smp.barrier()
write_result({"per_step": per_step, "rank": smp.rank(),
              "memory": {"peak_live_bytes": peaks, "live_between_steps": live_between_steps}
              if args.track_memory else None})
