"""One job of benchmarks/launch_overhead.py, started the way users start it: ``--role smp`` through
``smp-adapter launch`` (an smp v1 script; its options come from the launcher's SM_HP_MP_PARAMETERS),
``--role native`` through torchrun (a hand-written DeepSpeed loop). Each rank writes the wall time of
every step (after a barrier) and this process's CPU time in it to OUT/<role>_rank<R>.json.

The smp side is written for GPUs, as smp scripts are: ``torch.cuda.set_device`` and batches moved to
``torch.device("cuda")`` where torch.cuda says a GPU exists, which on a CPU machine is the case
exactly when the launcher turned CUDA on CPU ranks on; otherwise the CPU.

The native side is what a user writes by hand for the engine the smp options select (``--native-loop``):
  deepspeed   ``deepspeed.initialize`` and engine(batch) / engine.backward(loss) / engine.step() per microbatch;
  pipelining  torch.distributed.pipelining: ``pipeline()`` split before block ``n_layer // 2`` (where the
              adapter's partition cuts this model, printed by the job), Schedule1F1B over the microbatches,
              the loss (GPT-2's shifted cross entropy) on the last stage, AdamW over the stage's parameters;
  fsdp2       ``fully_shard`` on a (replicate, shard) DeviceMesh, every transformer block a unit and the model
              the root, each microbatch's loss divided by their number, the replicas' all-reduce only in the
              last microbatch's backward, the gradient norm clipped at smp's ``sdp_gradient_clipping`` default (1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import LR, batch, build_model, deepspeed_lm_step, lm_train_step, quiet  # noqa: E402
from _profile import profile_steps  # noqa: E402
from _turnstile import Turn  # noqa: E402


def smp_loop(args):
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init()
    quiet()
    if torch.cuda.is_available():  # a GPU script; under CUDA on CPU ranks this is the CPU
        torch.cuda.set_device(smp.local_rank())
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
    model = smp.DistributedModel(build_model(**json.loads(args.model)))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    train_step = lm_train_step(smp)

    def step(x):
        optimizer.zero_grad()
        loss_mb = train_step(model, x)
        optimizer.step()
        return loss_mb.reduce_mean().item()

    return step, device, smp.rank(), smp.dp_rank()


def deepspeed_loop(args):
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    quiet()
    model = build_model(**json.loads(args.model))
    engine, _, _, _ = deepspeed.initialize(model=model, config=json.loads(Path(args.native_config).read_text()),
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                           dist_init_required=False)
    return deepspeed_lm_step(engine), torch.device("cpu"), dist.get_rank(), dist.get_rank()


def pipelining_loop(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(**json.loads(args.model))

    class Logits(torch.nn.Module):  # the stages pass hidden states; the loss is computed by the schedule
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids).logits

    def loss_fn(logits, labels):  # GPT-2's own: the next token's cross entropy, mean over tokens
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    m = args.microbatches
    cut = model.config.n_layer // 2
    example = batch(0, 0)[: batch(0, 0).shape[0] // m]
    pipe = pipeline(Logits(model), mb_args=(example,), split_spec={f"lm.transformer.h.{cut}": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    if rank == 0:
        print(f"native pipelining: {world} stages, cut before transformer.h.{cut}", flush=True)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)  # its grad scaling averages the microbatches
    optimizer = torch.optim.AdamW(stage.submod.parameters(), lr=LR)
    last = rank == world - 1

    def step(x):
        optimizer.zero_grad()
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=x, losses=losses)
        optimizer.step()
        return torch.stack(losses).mean().item() if last else None

    return step, torch.device("cpu"), rank, 0  # every stage trains on the first stage's batches


def fsdp2_loop(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
    model = build_model(**json.loads(args.model))
    for unit in [*model.transformer.h, model]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no AVG reduction (pytorch#162338)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    m = args.microbatches

    def step(x):
        optimizer.zero_grad()
        losses = []
        for i, mb in enumerate(x.chunk(m)):
            model.set_requires_all_reduce(i == m - 1, recurse=True)
            loss = model(input_ids=mb, labels=mb).loss
            (loss / m).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return torch.stack(losses).mean().item()

    return step, torch.device("cpu"), rank, rank


LOOPS = {"smp": smp_loop, "deepspeed": deepspeed_loop, "pipelining": pipelining_loop, "fsdp2": fsdp2_loop}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("smp", "native"), required=True)
    p.add_argument("--native-loop", choices=("deepspeed", "pipelining", "fsdp2"), default="deepspeed")
    p.add_argument("--model", default="{}", help="GPT-2 config overrides (JSON)")
    p.add_argument("--native-config", default=None, help="DeepSpeed config file of the native loop")
    p.add_argument("--microbatches", type=int, default=2, help="the native loop's (the smp options' microbatches)")
    p.add_argument("--shard", type=int, default=2, help="fsdp2: ranks per shard group (sdp)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, N more under cProfile (benchmarks/_profile.py), into the rank's file")
    p.add_argument("--out", required=True)
    p.add_argument("--turnstile", default=None, help="HOST:PORT of the driver granting steps in turns (_turnstile.py)")
    p.add_argument("--turn-name", default="job", help="this job's name at the turnstile")
    p.add_argument("--pin", action="store_true", help="bind local rank i to CPU i mod the CPUs this job may use")
    args, _ = p.parse_known_args()  # launch puts --mp_parameters first, as SageMaker did
    if args.pin:  # before torch starts its threads, which inherit the binding
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    quiet()
    import torch.distributed as dist

    step, device, rank, data_rank = LOOPS["smp" if args.role == "smp" else args.native_loop](args)
    quiet()
    times, cpu_times, losses = [], [], []
    turn = Turn(args.turnstile, args.turn_name, dist.get_rank(), dist)  # without a turnstile: barriers only
    for i in range(args.warmup + args.steps):
        x = batch(i, data_rank).to(device)
        with turn:  # every rank starts the step together (a barrier)
            c0, t0 = time.process_time(), time.perf_counter()
            losses.append(step(x))
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
    result = {"times": times, "cpu_times": cpu_times, "losses": losses}
    if args.profile:
        result["profile"] = profile_steps({args.role: step}, lambda i: batch(i, data_rank).to(device),
                                          args.warmup + args.steps, args.profile, dist)[args.role]
    Path(args.out, f"{args.role}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
