"""The smp v1 script of benchmarks/cluster_comm.py: a parameter-heavy MLP (3.4M parameters, fp32: 13.7 MB),
so that on CPU ranks communication, not compute, dominates a step; or, with ``--hf-config CONFIG.json``, the
Hugging Face causal LM that config describes (random token ids of ``--seq-len``; what ``smp-adapter plan
--model`` reads, so plan's predictions can stand beside the measured steps). Options from SM_HP_MP_PARAMETERS (set by
smp-adapter launch). Between its warm-up and its timed steps, and after them, rank 0 hands over to the
benchmark (files in $BENCH_SYNC: ``start`` / ``go``, ``end`` / ``ack``) so that the link's byte counters are
read while every rank waits: the bytes counted are those of the timed steps only."""

import argparse
import json
import os
import time
from pathlib import Path

import smdistributed.modelparallel.torch as smp
import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--warmup", type=int, default=1)
parser.add_argument("--per-rank-batch", type=int, default=32)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--io", type=int, default=640)
parser.add_argument("--hf-config", help="a Hugging Face config.json: train that causal LM instead of the MLP")
parser.add_argument("--seq-len", type=int, default=64, help="--hf-config: tokens per sample")
args, _ = parser.parse_known_args()

smp.init({"ddp": True})
torch.manual_seed(0)
with smp.model_creation():
    if args.hf_config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.hf_config)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = nn.Sequential(nn.Linear(args.io, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                              nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.io))
params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))


@smp.step
def train_step(model, x, y):
    loss = model(input_ids=x, labels=y).loss if args.hf_config else nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + smp.rank())
    if args.hf_config:
        x = torch.randint(0, config.vocab_size, (args.per_rank_batch, args.seq_len), generator=g)
        return x, x
    x = torch.randn(args.per_rank_batch, args.io, generator=g)
    return x, x.tanh()


def handover(mine: str, theirs: str) -> None:
    """Rank 0 tells the benchmark where the job is and waits (at most 120 s) for its answer; all ranks wait."""
    sync = os.environ.get("BENCH_SYNC")
    if sync and smp.rank() == 0:
        Path(sync, mine).write_text(str(time.time()))
        deadline = time.monotonic() + 120
        while not Path(sync, theirs).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark did not answer {mine!r} in 120 s")
            time.sleep(0.05)
    dist.barrier()


def one_step(step):
    optimizer.zero_grad()
    loss = train_step(model, *batch(step)).reduce_mean()
    optimizer.step()
    return loss.item()


for step in range(args.warmup):
    one_step(step)
handover("start", "go")
times, losses = [], []
for step in range(args.warmup, args.warmup + args.steps):
    t0 = time.perf_counter()
    losses.append(one_step(step))
    dist.barrier()  # a step ends when every rank ended it
    times.append(time.perf_counter() - t0)
handover("end", "ack")
out = Path(os.environ.get("BENCH_OUT", "."))
(out / f"rank{smp.rank()}.json").write_text(json.dumps({"step_s": times, "losses": losses, "params": params,
                                                         "rdp": smp.rdp_size()}))
