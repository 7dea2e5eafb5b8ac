"""A tiny MLP trained a few steps, meeting what a job that runs for days meets: a NaN batch, a full
disk at a save, a damaged newest checkpoint, a preemption (SIGTERM), a rank that hangs. Options come
from SM_HP_MP_PARAMETERS (the test, or smp-adapter launch). Each rank writes its result
(launch_util.write_result) unless the job fails."""

import argparse
import errno
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smp_adapter.errors import SMPCheckpointError  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--nan-at-step", type=int, default=-1, help="this step's batch holds a NaN on --nan-rank")
parser.add_argument("--nan-until-step", type=int, default=-1, help="... and every step up to this one")
parser.add_argument("--nan-rank", type=int, default=1)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--keep", type=int, default=None, help="num_kept_partial_checkpoints")
parser.add_argument("--ckpt-dir", default="ckpt")
parser.add_argument("--fill-disk-after", type=int, default=-1, help="after the save at this step, fill its disk")
parser.add_argument("--fake-enospc-after", type=int, default=-1,
                    help="after the save at this step, every checkpoint file write raises ENOSPC (no small disk here)")
parser.add_argument("--fake-enospc-rank", type=int, default=-1, help="--fake-enospc-after on this rank only")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--try-tag", default=None, help="first resume this explicit tag, recording its refusal")
parser.add_argument("--until-sigterm", action="store_true", help="train until SIGTERM, then save and exit 0")
parser.add_argument("--ready-file", default=None, help="--until-sigterm: created once training runs")
parser.add_argument("--save-delay", type=float, default=0.0,
                    help="--until-sigterm: seconds before the save (a large checkpoint's write time)")
parser.add_argument("--hang-rank", type=int, default=-1, help="this rank sleeps at --hang-at-step (a stuck rank)")
parser.add_argument("--hang-at-step", type=int, default=2)
parser.add_argument("--raise-rank", type=int, default=-1, help="this rank raises RuntimeError at --raise-at-step")
parser.add_argument("--raise-at-step", type=int, default=3)
parser.add_argument("--width", type=int, default=16, help="hidden width (256: checkpoints of ~0.1 MB per save)")
parser.add_argument("--lr", type=float, default=0.05, help="SGD's (--width 8192 needs less: 0.05 diverges there)")
parser.add_argument("--raise-save-errors", action="store_true",
                    help="a failed save ends the job, as in a script that does not catch it (the failure drill)")
args, _ = parser.parse_known_args()

smp.init({"ddp": True})
torch.manual_seed(0)
with smp.model_creation():
    model = nn.Sequential(nn.Linear(8, args.width), nn.Tanh(), nn.Linear(args.width, 1))
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr))


@smp.step
def train_step(model, x, y):
    loss = nn.functional.mse_loss(model(x).float(), y)
    model.backward(loss)
    return loss


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + smp.rank())
    x = torch.randn(4, 8, generator=g)
    last = max(args.nan_at_step, args.nan_until_step)
    if args.nan_at_step <= step <= last and smp.rank() == args.nan_rank:
        x[0, 0] = float("nan")
    return x, x.sum(1, keepdim=True).tanh()


def fill_disk(folder: str) -> None:
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def fake_enospc() -> None:
    """Every checkpoint file write raises ENOSPC from now on: the files written hashed, and DeepSpeed's copy of
    its recovery script (written beside its checkpoint engine, rank 0 only)."""
    from smp_adapter.runtime.checkpoint.integrity import hashing_io

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def copyfile(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)

    hashing_io.HashingFile.write = write
    if "deepspeed.runtime.engine" in sys.modules:
        sys.modules["deepspeed.runtime.engine"].copyfile = copyfile


result = {"save_errors": [], "saved": []}
first = 0
if args.try_tag:
    try:
        smp.resume_from_checkpoint(args.ckpt_dir, tag=args.try_tag)
    except SMPCheckpointError as exc:
        result["explicit_tag_error"] = str(exc)
if args.resume:
    first = smp.resume_from_checkpoint(args.ckpt_dir)["step"]
    result["resumed_step"] = first

preempted = [False]
if args.until_sigterm:  # the managed-spot / Kubernetes pattern: save on SIGTERM, exit 0
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.__setitem__(0, True))

losses, step = [], first
while step < first + args.steps or args.until_sigterm:
    if args.until_sigterm:
        stop = torch.tensor(float(preempted[0]))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            time.sleep(args.save_delay)
            smp.save_checkpoint(args.ckpt_dir, tag=f"step{step}", user_content={"step": step})
            result["saved"].append(step)
            break
        if step == 2 and args.ready_file and smp.rank() == 0:
            open(args.ready_file, "w").close()
        time.sleep(0.02)
    if smp.rank() == args.hang_rank and step == args.hang_at_step:
        time.sleep(600)
    if smp.rank() == args.raise_rank and step == args.raise_at_step:  # a bug in the user's code, on one rank
        raise RuntimeError(f"the user's code failed on rank {smp.rank()} in its step {step} (failure drill)")
    optimizer.zero_grad()
    x, y = batch(step)
    losses.append(train_step(model, x, y).reduce_mean().item())
    optimizer.step()
    step += 1
    if args.save_every and step % args.save_every == 0:
        try:
            smp.save_checkpoint(args.ckpt_dir, tag=f"step{step}", user_content={"step": step},
                                num_kept_partial_checkpoints=args.keep)
            result["saved"].append(step)
        except SMPCheckpointError as exc:
            if args.raise_save_errors:
                raise
            result["save_errors"].append(str(exc))
        if step == args.fill_disk_after and smp.rank() == 0:
            fill_disk(args.ckpt_dir)
        if step == args.fake_enospc_after and args.fake_enospc_rank in (-1, smp.rank()):
            fake_enospc()
        dist.barrier()

params = [p.detach().float() for p in model.parameters() if not p.is_meta]  # pp: the other stage's are meta
if model.engine is not None and model.engine.zero_optimization_stage() == 3:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
        params = [p.detach().float().clone() for p in model.module.parameters()]
write_result({**result, "losses": losses, "last_step": step,
              "params_finite": all(bool(torch.isfinite(p).all()) for p in params)})
