"""One pipeline rank's stage on a GPU, in one process: the deep MLP of
tests/distributed/scripts/pipeline_memory.py created (delayed, or whole on the GPU), then
stage_memory.keep_stage, the step the pipeline engine runs after partitioning, keeps stage S of P
layers-contiguous stages on cuda:0 and turns every other tensor meta. Prints, as JSON, what CUDA's
allocator counts (torch.cuda.memory_allocated now, the peak since the model was created) against
the model's bytes, and whether the kept values equal the model built normally (same seed, on the
GPU: delayed replay of CUDA random draws runs on a CUDA generator set to the recorded state).

    python tests/gpu/pipeline_stage_script.py --pp 2 --stage 0 [--delayed 0] [--build-on host] [--device cpu]

The pipeline itself (two ranks exchanging activations) needs a GPU per rank: NCCL refuses two ranks
on one GPU and gloo sends no CUDA tensors, so on a one-GPU machine this is the rank's memory check."""

import argparse
import json

import torch
from torch import nn

from smp_adapter.runtime.deferred_init import DeferredInit
from smp_adapter.runtime.engines.pipeline import stage_memory


def build(layers: int, width: int, device) -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width, device=device), nn.Tanh()) for _ in range(layers)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--delayed", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--build-on", choices=("device", "host"), default="device",
                   help="host: created on the CPU, as a script that lets DistributedModel move it does")
    args = p.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    cuda = device.type == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    build_on = device if args.build_on == "device" else torch.device("cpu")
    base = allocated()
    record = None
    if args.delayed:
        record = DeferredInit()
        with record.creating():
            model = build(args.layers, args.width, build_on)
    else:
        model = build(args.layers, args.width, build_on)
    after_creation = allocated() - base
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    per_stage = args.layers // args.pp
    mine = list(model)[args.stage * per_stage:(args.stage + 1) * per_stage]
    stage_memory.keep_stage(model, stage_memory.stage_tensors(mine), record, device)
    if cuda:
        torch.cuda.synchronize(device)
    held = allocated() - base
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else 0
    reference = build(args.layers, args.width, build_on).to(device)
    ref_mine = list(reference)[args.stage * per_stage:(args.stage + 1) * per_stage]
    equal = all(torch.equal(a, b) for m, r in zip(mine, ref_mine) for a, b in zip(m.parameters(), r.parameters()))
    others_meta = all(t.is_meta for m in list(model)[:args.stage * per_stage] + list(model)[(args.stage + 1) * per_stage:]
                      for t in m.parameters())
    # a step on what the stage holds: the kept tensors are usable parameters on the device
    x = torch.randn(4, args.width, device=device)
    out = x
    for m in mine:
        out = m(out)
    out.square().mean().backward()
    grads = all(t.grad is not None and t.grad.device == device for m in mine for t in m.parameters())
    print(json.dumps({"pp": args.pp, "stage": args.stage, "delayed": bool(args.delayed), "device": str(device),
                      "built_on": str(build_on),
                      "model_bytes": model_bytes, "allocated_after_creation": after_creation,
                      "allocated_after_keep_stage": held, "peak_allocated": peak, "values_equal": equal,
                      "other_stages_meta": others_meta, "gradients_on_device": grads}))


if __name__ == "__main__":
    main()
