"""One rank of `benchmarks/kernel_memory.py`: a model created, wrapped and trained for a few SGD steps,
its memory read from the kernel (/proc/self/status VmRSS and VmHWM) over a baseline taken right before
the model exists (after one tiny layer's step: torch's lazy set-up), with the peak reset there
(/proc/self/clear_refs 5) so that imports and smp.init's own peak do not count.

  --mode plain   plain PyTorch, one process, no smp (the reference)
  --mode smp     the smp API: smp.init(SMP_OPTIONS), the model created inside
                 smp.delay_param_initialization(), smp.DistributedModel, smp.DistributedOptimizer

SGD without momentum: no optimizer state of torch's own, so what a rank holds beyond parameters and
gradients is the engine's (masters, flat copies, buckets). The benchmark sets glibc's mmap threshold
so freed tensors leave RSS. The rank also counts its live tensor bytes by storage (every tensor the
garbage collector reaches, each storage once) and sorts them into parameters (what the rank holds of
each parameter: its shard, or the whole tensor), gradients, and other tensors (engine buffers,
optimizer masters and flat copies, communication buckets), at the end of the run; what RSS holds
beyond the tensors is the allocator's and the libraries'.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH, SEQ = 3, 4, 64


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident set size (VmHWM)
        f.write("5")


def build(name: str):
    if name == "gpt2_pretrained":  # the GPT-2 below as `save_pretrained` wrote it (safetensors), loaded as users do
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel.from_pretrained(os.environ["KERNEL_MEMORY_CHECKPOINT"])
    if name == "mlp":
        layers = []
        for _ in range(16):
            layers += [nn.Linear(2048, 2048), nn.Tanh()]
        return nn.Sequential(*layers)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=4, n_head=16, vocab_size=8192, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def batches(name: str, replicas: int, replica: int):
    g = torch.Generator().manual_seed(11)
    rows = BATCH * replicas
    for _ in range(STEPS):
        data = torch.randn(rows, 2048, generator=g) if name == "mlp" else torch.randint(0, 8192, (rows, SEQ), generator=g)
        yield data[replica * BATCH:(replica + 1) * BATCH]


def loss_of(name: str, model, data):
    if name == "mlp":
        return F.mse_loss(model(data), torch.zeros_like(data))
    out = model(input_ids=data, labels=data)
    return out["loss"]


def tensor_bytes(params, grads) -> dict:
    """Live tensor bytes by storage: parameters (this rank's part), gradients, and every other tensor."""
    gc.collect()
    seen, out = set(), {"parameters": 0, "gradients": 0, "other": 0}

    def add(kind, t):
        if not isinstance(t, torch.Tensor) or t.is_meta or t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # fake or functional tensors (a pipeline's traced graph)
            return
        if key and key not in seen:
            seen.add(key)
            out[kind] += storage.nbytes()

    for t in params:
        add("parameters", t)
    for t in grads:
        add("gradients", t)
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add("other", obj.to_local() if hasattr(obj, "to_local") else obj)
    return out


def local_parts(model):
    """(this rank's parameter tensors, its gradient tensors), whatever engine holds them."""
    params, grads = [], []
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        params.append(local)
        g = p.grad
        if g is not None:
            grads.append(g.to_local() if hasattr(g, "to_local") else g)
    return params, grads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("mlp", "gpt2", "gpt2_pretrained"), required=True)
    parser.add_argument("--mode", choices=("plain", "smp", "save"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import transformers  # noqa: F401  (imported before the baseline in both modes)

    if args.mode == "smp":
        import smdistributed.modelparallel.torch as smp

        smp.init(json.loads(os.environ["SMP_OPTIONS"]))
        replicas, replica, rank = smp.rdp_size(), smp.rdp_rank(), smp.rank()
    else:
        replicas, replica, rank = 1, 0, 0
    # Code, not the model: torch's one-time lazy set-up at the first layer it builds (~75 MiB here, with
    # or without smp), torch._dynamo with sympy (~71 MiB of modules), which the first recorded
    # creation imports (through torch.fx's symbolic shapes) as FSDP2 and transformers often do anyway,
    # and the model's own modeling module. All run before the baseline, in both modes.
    import torch._dynamo  # noqa: F401

    if args.mode == "save":  # the checkpoint gpt2_pretrained loads: the GPT-2 of seed 1234
        torch.manual_seed(1234)
        build("gpt2").save_pretrained(args.out)
        return 0

    if args.model.startswith("gpt2"):  # transformers' GPT-2 modules (~26 MiB of code), imported lazily by the first build
        from transformers import GPT2LMHeadModel  # noqa: F401

    nn.Linear(8, 8)(torch.randn(2, 8)).sum().backward()
    gc.collect()
    base = status("VmRSS")
    reset_peak()
    torch.manual_seed(1234)
    if args.mode == "smp":
        if args.model == "gpt2_pretrained":  # loaded weights: nothing to delay
            module = build(args.model)
        else:
            with smp.delay_param_initialization(enabled=True):
                module = build(args.model)
        model = smp.DistributedModel(module)
        wrap_peak = status("VmHWM") - base
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

        @smp.step
        def train_step(model, data):
            loss = loss_of(args.model, model, data)
            model.backward(loss)
            return loss
    else:
        model = build(args.model)
        wrap_peak = status("VmHWM") - base
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for data in batches(args.model, replicas, replica):
        optimizer.zero_grad()
        if args.mode == "smp":
            loss = train_step(model, data).reduce_mean()
        else:
            loss = loss_of(args.model, model, data)
            loss.backward()
        optimizer.step()
        losses.append(float(loss))
    gc.collect()
    figures = {"wrap_peak": wrap_peak, "run_peak": status("VmHWM") - base, "after": status("VmRSS") - base,
               "losses": losses, "tensors": tensor_bytes(*local_parts(model)),
               "model_bytes": sum(p.numel() * 4 for p in build_shapes(args.model))}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    if args.mode == "smp":
        smp.barrier()


def build_shapes(name: str):
    """The model's parameters on the meta device (``parameters()`` yields a tied weight once)."""
    with torch.device("meta"):
        return list(build("gpt2" if name == "gpt2_pretrained" else name).parameters())


if __name__ == "__main__":
    sys.exit(main())
