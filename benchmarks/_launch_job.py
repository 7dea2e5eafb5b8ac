"""One job of benchmarks/launch_overhead.py, started the way users start it: ``--role smp`` through
``smp-adapter launch`` (an smp v1 script; its options come from the launcher's SM_HP_MP_PARAMETERS),
``--role native`` through torchrun (a hand-written DeepSpeed loop). Each rank writes the wall time of
every step (after a barrier) and this process's CPU time in it to OUT/<role>_rank<R>.json.

The smp side is written for GPUs, as smp scripts are: ``torch.cuda.set_device`` and batches moved to
``torch.device("cuda")`` where torch.cuda says a GPU exists, which on a CPU machine is the case
exactly when the launcher turned CUDA on CPU ranks on; otherwise the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import LR, batch, build_model, lm_train_step, quiet  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("smp", "native"), required=True)
    p.add_argument("--model", default="{}", help="GPT-2 config overrides (JSON)")
    p.add_argument("--native-config", default=None, help="DeepSpeed config file of the native loop")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    args, _ = p.parse_known_args()  # launch puts --mp_parameters first, as SageMaker did
    quiet()
    import torch
    import torch.distributed as dist

    if args.role == "smp":
        import smdistributed.modelparallel.torch as smp

        smp.init()
        quiet()
        if torch.cuda.is_available():  # a GPU script; under CUDA on CPU ranks this is the CPU
            torch.cuda.set_device(smp.local_rank())
            device = torch.device("cuda")
        else:
            device = torch.device("cpu")
        rank = smp.rank()
        model = smp.DistributedModel(build_model(**json.loads(args.model)))
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
        train_step = lm_train_step(smp)

        def step(x):
            optimizer.zero_grad()
            loss_mb = train_step(model, x)
            optimizer.step()
            return loss_mb.reduce_mean().item()
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        quiet()
        device, rank = torch.device("cpu"), dist.get_rank()
        model = build_model(**json.loads(args.model))
        engine, _, _, _ = deepspeed.initialize(model=model, config=json.loads(Path(args.native_config).read_text()),
                                               optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                               dist_init_required=False)
        gas = engine.gradient_accumulation_steps()

        def step(x):
            losses = []
            for mb in x.chunk(gas):
                loss = engine(input_ids=mb, labels=mb).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            return torch.stack(losses).mean().item()

    times, cpu_times, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x = batch(i, rank).to(device)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(step(x))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    Path(args.out, f"{args.role}_rank{rank}.json").write_text(json.dumps({"times": times, "cpu_times": cpu_times,
                                                                                 "losses": losses}))
    dist.barrier()


if __name__ == "__main__":
    main()
