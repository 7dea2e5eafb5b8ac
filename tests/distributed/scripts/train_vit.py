"""Seed-style sharded-data-parallel script (shared/seeds/002): a ViT from its config class, wrapped
by smp, activation checkpointing on each encoder layer, @smp.step with model.backward. Options come
from SM_HP_MP_PARAMETERS (set by the test, as SageMaker's launcher does)."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import global_batch, make_optimizer, tiny_cnn, tiny_vit, vit_layers  # noqa: E402
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="vit", choices=["vit", "vit-frozen", "cnn"],
                    help="vit-frozen: the embeddings frozen (requires_grad False), as fine-tunes do; cnn: common.TinyConvNet")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--first-step", type=int, default=0)
parser.add_argument("--per-rank-batch", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--save-at", type=int, default=-1)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--ckpt-dir", default="ckpt")
parser.add_argument("--checkpoint-activations", action="store_true")
parser.add_argument("--torch-clip", type=float, default=None,
                    help="torch.nn.utils.clip_grad_norm_(model.parameters(), n) before each step (a plain script's clip)")
parser.add_argument("--init-weights", default=None, help="state dict to load after wrapping (fine-tune style)")
parser.add_argument("--nan-in-shard-padding", action="store_true",
                    help="fill the padding of every ZeRO-3 shard with NaN after creation (DeepSpeed leaves it unwritten)")
parser.add_argument("--raise-at-step", type=int, default=-1, help="failure test: --raise-rank raises at this step")
parser.add_argument("--raise-rank", type=int, default=1)
parser.add_argument("--die-in-save", action="store_true", help="failure test: rank 1 is SIGKILLed mid-save")
parser.add_argument("--loss-scale", default=None, help="fp16: static:<scale> or dynamic:<initial scale>")
args, _ = parser.parse_known_args()

smp.init({"ddp": True})
if args.nan_in_shard_padding:
    # the padding DeepSpeed adds to even out shards is torch.empty (any bits: NaN is what CI once met
    # there): fill it with NaN wherever DeepSpeed makes shards, as such an allocator would
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import Init

    def poison_padding(params):
        for p in params:
            place = dist.get_rank(group=p.ds_process_group) * p.ds_tensor.numel()
            p.ds_tensor.data[max(0, min(p.ds_tensor.numel(), p.ds_numel - place)):] = float("nan")

    def convert_then_poison(self, params, _convert=Init._convert_to_zero_parameters):
        params = list(params)
        _convert(self, params)
        poison_padding(params)

    Init._convert_to_zero_parameters = convert_then_poison
with smp.model_creation():  # delayed parameter initialization under sdp
    model = tiny_cnn() if args.model == "cnn" else tiny_vit()
if args.model == "vit-frozen":
    for p in model.vit.embeddings.parameters():
        p.requires_grad_(False)
total_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
model = smp.DistributedModel(model)
if args.init_weights:  # smp rule: load weights after wrapping
    model.load_state_dict(smp.load(args.init_weights, partial=False))
if args.checkpoint_activations:
    for layer in vit_layers(model.get_module()):
        smp.set_activation_checkpointing(layer)
scaling = {}
if args.loss_scale:
    kind, value = args.loss_scale.split(":")
    scaling = ({"static_loss_scale": float(value)} if kind == "static" else
               {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": float(value)}})
optimizer = smp.DistributedOptimizer(make_optimizer(model.parameters(), args.optimizer, args.lr), **scaling)
loss_function = torch.nn.CrossEntropyLoss()


@smp.step
def train_step(model, inputs, targets):
    outputs = model(inputs)
    loss = loss_function(outputs["logits"], targets)
    model.backward(loss)
    return loss


if args.die_in_save and int(os.environ["RANK"]) == 1:
    import signal

    _real_save = torch.save

    saves = []

    def dying_save(obj, f, *a, **k):  # in the 2nd checkpoint, DeepSpeed's shards are written: die
        if "rng_rank" in str(getattr(f, "name", f)):  # a path, or the file object smp-adapter writes through
            saves.append(f)
            if len(saves) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return _real_save(obj, f, *a, **k)

    torch.save = dying_save

if args.resume:
    content = smp.resume_from_checkpoint(args.ckpt_dir)
    assert content["step"] == args.first_step, content

B = args.per_rank_batch
losses, first_params, saved_state = [], None, None
overflows, scales, checksums = [], [], []  # per step: skipped as an fp16 overflow, the scale it ran at, shards' sum
model.train()
for step in range(args.first_step, args.first_step + args.steps):
    images, labels = global_batch(step, B * smp.dp_size())
    lo = smp.dp_rank() * B
    if step == args.raise_at_step and smp.rank() == args.raise_rank:
        # when it failed (wall clock), for the tests that bound how long the job takes to end after it
        Path(os.environ.get("SMP_TEST_OUT", "."), f"failed_at.rank{smp.rank()}").write_text(repr(time.time()))
        raise RuntimeError(f"injected failure in rank {smp.rank()} at step {step}")
    optimizer.zero_grad()
    loss_mb = train_step(model, images[lo:lo + B], labels[lo:lo + B])
    # the loss of the whole global batch, as the single-process reference computes it
    loss = torch.tensor(loss_mb.reduce_mean().item())
    torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
    losses.append(loss.item() / smp.dp_size())
    if args.torch_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.torch_clip)
    scales.append(optimizer.loss_scale)
    optimizer.step()
    overflows.append(optimizer.overflow)
    checksums.append(sum(float(p.to_local().double().sum()) if hasattr(p, "to_local") else float(p.double().sum())
                         for p in model.module.parameters()))
    if step == args.first_step and not args.resume:
        first_params = {k: v.tolist() for k, v in model.state_dict().items()}  # collective under ZeRO-3
    if step + 1 == args.save_at or (args.die_in_save and step + 1 == 2):
        smp.save_checkpoint(args.ckpt_dir, tag=f"step{step + 1}", partial=True, user_content={"step": step + 1})
        saved_state = {k: v.tolist() for k, v in model.state_dict().items()}  # what the checkpoint holds

squares = None
if args.nan_in_shard_padding:  # the templates' norm logging: squares of the shards, summed over the group
    import deepspeed

    shard_squares = sum(p.ds_tensor.data.float().pow(2).sum() for p in model.module.parameters())
    torch.distributed.all_reduce(shard_squares, group=optimizer.ds_param_shard_group)
    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):  # the whole tensors
        whole_squares = sum(p.data.float().pow(2).sum() for p in model.module.parameters())
    squares = [shard_squares.item(), whole_squares.item()]

engine = model.engine  # DeepSpeed's; None on the MiCS engine (FSDP2 shards: DTensors)
stage = engine.zero_optimization_stage() if engine is not None else "mics"


def held_bytes(p):
    """Bytes of this parameter held on this rank: its shard(s), plus the full tensor if it is live."""
    if hasattr(p, "to_local"):  # an FSDP2 shard
        return p.to_local().numel() * p.element_size()
    if not hasattr(p, "ds_tensor"):
        return p.numel() * p.element_size()
    secondary = getattr(p, "ds_secondary_tensor", None)  # hpZ's second shard
    return (p.ds_tensor.numel() + p.data.numel() + (secondary.numel() if secondary is not None else 0)) * p.element_size()


param_bytes = sum(held_bytes(p) for p in model.module.parameters())
opt = engine.optimizer if engine is not None else optimizer.optimizer  # the torch optimizer smp wraps
local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
moments = [local(t) for st in getattr(opt, "optimizer", opt).state.values() for k, t in st.items()
           if k in ("exp_avg", "exp_avg_sq")]
master = list(getattr(opt, "fp32_partitioned_groups_flat", []))
opt_bytes = sum(t.numel() * t.element_size() for t in moments + master)
grad_bytes = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.module.parameters()
                 if p.grad is not None)
write_result({"losses": losses, "overflows": overflows, "scales": scales, "checksums": checksums,
              "scale_after": optimizer.loss_scale, "squares": squares, "first_params": first_params, "saved_state": saved_state, "zero_stage": stage, "param_bytes": param_bytes,
              "buffers": {k: v.tolist() for k, v in model.module.named_buffers()},  # BatchNorm statistics
              "opt_bytes": opt_bytes,
              "adam_moment_bytes": sum(t.numel() * t.element_size() for t in moments), "total_param_bytes": total_params * 4, "dp_size": smp.dp_size(),
              "grad_bytes": grad_bytes,
              "hpz": engine.zero_hpz_partition_size() if stage == 3 else 1,
              # graphs torch.compile captured (SMP_ADAPTER_COMPILE=blocks); 0 when dynamo never ran
              "dynamo_graphs": (sys.modules["torch._dynamo.utils"].counters["stats"]["unique_graphs"]
                                if "torch._dynamo.utils" in sys.modules else 0)})
