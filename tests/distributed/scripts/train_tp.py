"""Seed-style tensor-parallel scripts (shared/seeds/000): the conv + linear net created inside
smp.tensor_parallelism() and trained with plain loss.backward()/optimizer.step(), or a tiny GPT-2
marked with smp.tensor_parallelism() and trained with @smp.step. Data is sharded by dp_rank, as in
the seed (each TP rank reads its own batch unless prescaled_batch, then by rdp_rank)."""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402
from tp_common import Net, batch_for, tiny_gpt2  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="convnet")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--per-rank-batch", type=int, default=4)
parser.add_argument("--save-hf", default=None)
parser.add_argument("--clip", type=float, default=None, help="optimizer.clip_master_grads(max_norm) before each step")
parser.add_argument("--clip-with", default="smp", choices=["smp", "torch", "both"],
                    help="clip with optimizer.clip_master_grads, torch.nn.utils.clip_grad_norm_(model.parameters()), "
                         "or the two on alternate steps")
parser.add_argument("--optimizer", default="sgd", help="sgd (lr 0.05) or adam (lr 1e-3)")
parser.add_argument("--first-step", type=int, default=0)
parser.add_argument("--save-at", type=int, default=-1, help="save a partial checkpoint after this many steps")
parser.add_argument("--resume", action="store_true", help="resume_from_checkpoint(--ckpt-dir) before training")
parser.add_argument("--ckpt-dir", default="ckpt")
args, _ = parser.parse_known_args()

smp.init()
torch.manual_seed(42 + smp.dp_rank())  # the seeding smp asks for; the model is synced from dp rank 0
with smp.tensor_parallelism():
    model = Net() if args.model == "convnet" else tiny_gpt2()
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05) if args.optimizer == "sgd"
                                     else torch.optim.Adam(model.parameters(), lr=1e-3))
if args.resume:
    assert smp.resume_from_checkpoint(args.ckpt_dir)["step"] == args.first_step
split = {n: tuple(p.shape) for n, p in model.module.named_parameters() if model.is_distributed_parameter(p)}

prescaled = smp.state.cfg.prescaled_batch
readers, reader_rank = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())
B = args.per_rank_batch
losses = []


@smp.step
def train_step(model, data, target):
    out = model(input_ids=data, labels=data)
    model.backward(out["loss"])
    return out["loss"]


saved_state = None
norms = []  # [what torch's clip_grad_norm_ returned, the optimizer's _global_grad_norm after the step]
model.train()
for step in range(args.first_step, args.first_step + args.steps):
    data, target = batch_for(args.model, step, B * readers)
    data, target = data[reader_rank * B:(reader_rank + 1) * B], target[reader_rank * B:(reader_rank + 1) * B]
    optimizer.zero_grad()
    if args.model == "convnet":  # the seed's plain PyTorch style
        output = model(data)
        loss = F.nll_loss(output, target, reduction="mean")
        loss.backward()
        loss = loss.detach()
    else:
        loss = train_step(model, data, target).reduce_mean()
    torch_norm = None
    if args.clip is not None and (args.clip_with == "torch" or (args.clip_with == "both" and step % 2)):
        # a plain script's (and the Trainer's) clip
        torch_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
    elif args.clip is not None:
        optimizer.clip_master_grads(args.clip)
    optimizer.step()
    if torch_norm is not None:  # beside the norm the engine's step computed itself, where it keeps one
        step_norm = getattr(optimizer, "_global_grad_norm", None)
        norms.append([torch_norm, None if step_norm is None else float(step_norm)])
    # mean over the readers = the loss of the whole global batch
    losses.append(sum(smp.allgather(loss.item(), smp.WORLD)) / smp.size())
    if step + 1 == args.save_at:
        smp.save_checkpoint(args.ckpt_dir, tag=f"step{step + 1}", partial=True, user_content={"step": step + 1})
        saved_state = {k: v.tolist() for k, v in model.state_dict().items()}  # what the checkpoint holds

hpz_group = None
if smp.state.dims.hpz_partition_size > 1:  # the group DeepSpeed's ZeRO-3 uses for hpZ (secondary shards)
    from deepspeed.utils import groups as ds_groups

    hpz_group = torch.distributed.get_process_group_ranks(ds_groups._get_zero_param_intra_parallel_group())
state = model.state_dict()  # gathered, original layout (collective over TP, and over RDP under ZeRO-3)
if args.save_hf and smp.rank() == 0:
    plain = tiny_gpt2()
    plain.load_state_dict(state)
    plain.save_pretrained(args.save_hf)
write_result({"losses": losses, "split": split, "final_state": {k: v.tolist() for k, v in state.items()},
              "saved_state": saved_state, "torch_clip_norms": norms,
              "readers": readers, "rank": smp.rank(), "hpz_group": hpz_group})
