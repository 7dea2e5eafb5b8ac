"""A deep MLP whose parameters dominate memory, created under smp.delay_param_initialization()
(or not: --delayed 0) and trained a few SGD steps at the job's pipeline degree. Each rank writes its
losses, its resident memory growth over the baseline taken just before the model is created (the
kernel's count: psutil's RSS now and after each step, getrusage's peak), and the bytes of parameter
storage it holds after the first step (distinct storages; another stage's parameters are meta).

Run through `smp-adapter launch --options '{"pipeline_parallel_degree": P, ...}' ... --results DIR`
(tests/distributed/test_pipeline_memory.py; benchmarks/memory.py --pipeline at a larger size)."""

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import resource

import psutil
import torch
import torch.nn.functional as F
from torch import nn

import smdistributed.modelparallel.torch as smp


def rss() -> int:
    return psutil.Process().memory_info().rss


def in_use_rss() -> int:
    """RSS once the C library has returned its free heap to the kernel: glibc keeps freed blocks of
    a few MB (activations, gradients set to None) resident, by a threshold that moves with what was
    freed before, so that the plain count after a step varied by 100 MB between the ranks of one
    pp 4 job; trimmed, it did not vary."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def held_parameter_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.is_meta:
            continue
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=int(os.environ.get("PM_STEPS", 3)))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--delayed", type=int, default=1)
    p.add_argument("--results", required=True)
    args, _ = p.parse_known_args()  # (launch also passes --mp_parameters, as SageMaker does)
    smp.init()
    # the code delayed initialisation runs (torch's meta kernels, ~70 MB of modules) is loaded by a
    # first use; the pipeline engine loads its own at smp.init. Loaded before the baseline at every
    # degree, so that the growth is the model's
    with smp.delay_param_initialization(enabled=args.delayed > 0):
        nn.Linear(2, 2)
    baseline = in_use_rss()
    torch.manual_seed(1234)
    with smp.delay_param_initialization(enabled=args.delayed > 0):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())
                                for _ in range(args.layers)])
    total_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    after_creation = in_use_rss()
    model = smp.DistributedModel(model)
    after_wrap = in_use_rss()
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(99)
    losses, samples, held = [], [], None
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randn(args.batch, args.width, generator=g) * 0.1
        optimizer.zero_grad(set_to_none=True)
        if step > 0:  # between steps: the parameters (SGD keeps no state), as the model holds them
            samples.append(in_use_rss() - baseline)
        losses.append(train_step(model, x, y).reduce_mean().item())
        optimizer.step()
        if held is None:
            held = held_parameter_bytes(model)
    result = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "pp": smp.pp_size(), "losses": losses,
              "model_bytes": total_bytes, "held_parameter_bytes": held,
              "rss_growth_after_creation": after_creation - baseline, "rss_growth_after_wrap": after_wrap - baseline,
              "rss_growth_per_step": samples, "rss_growth": max(samples),
              "peak_rss_growth": peak_rss() - baseline}
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"rank{smp.rank()}.json"), "w") as f:
        json.dump(result, f)
    smp.barrier()


if __name__ == "__main__":
    main()
