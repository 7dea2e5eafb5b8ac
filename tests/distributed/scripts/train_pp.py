"""Seed-style pipeline-parallel script (shared/seeds/000 TP+PP, 003 manual partition): the step body
is the seed's, unchanged; data is sharded by dp_rank. Options come from SM_HP_MP_PARAMETERS.

--model net     the seed's conv + linear Net (auto partition), fc1 marked with set_tensor_parallelism
--model manual  the seed's GroupedNet: modules created inside smp.partition(0) / smp.partition(1)
--model six     six linear layers, auto-partitioned
--model skip    four linear layers, the first one's output read again by the last two
--model gated   four linear layers, a boolean mask made on the first stage gating the third
--model gpt2    tiny GPT2LMHeadModel (the shifted LM loss computed in the step)
--model gptneo  tiny GPTNeoForCausalLM / GPTJForCausalLM whose configs keep use_cache=True, called as the
--model gptj    public templates call them (no use_cache= argument)

Checkpoints: --save-at N saves a partial checkpoint (smp.save_checkpoint) after step N; --resume
resumes from the newest one before the first step and trains steps --first-step ... on.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402
from train_pp_common import LM_MODELS, batch, build, make_optimizer  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="net")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--per-rank-batch", type=int, default=8)
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--first-step", type=int, default=0)
parser.add_argument("--save-at", type=int, default=-1)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--ckpt-dir", default="ckpt")
parser.add_argument("--loss-scale", default=None, help="fp16: static:<scale> or dynamic:<initial scale>")
parser.add_argument("--final-state", action="store_true",
                    help="report model.state_dict() at the end (also for gpt2) and right after --save-at")
parser.add_argument("--clip", type=float, default=None, help="optimizer.clip_master_grads(max_norm) before each step")
parser.add_argument("--clip-with", default="smp", choices=["smp", "torch", "both"],
                    help="clip with optimizer.clip_master_grads, torch.nn.utils.clip_grad_norm_(model.parameters()), "
                         "or the two on alternate steps")
parser.add_argument("--tp", action="store_true",
                    help="create the model inside smp.tensor_parallelism() (GPT-2's layers split over the TP ranks)")
parser.add_argument("--act-ckpt", action="store_true",
                    help="smp.set_activation_checkpointing on every Linear layer of the six-layer model")
parser.add_argument("--delayed", action="store_true",
                    help="create the model inside smp.delay_param_initialization(): each rank materialises its stage only")
args, _ = parser.parse_known_args()

smp.init()
with smp.tensor_parallelism(enabled=args.tp), smp.delay_param_initialization(enabled=args.delayed):
    model = build(args.model, smp)
if args.model == "net" and smp.tp_size() > 1:
    smp.set_tensor_parallelism(model.fc1, True)  # as the seed
if args.act_ckpt:  # recomputed in the backward: the same gradients, less activation memory
    for layer in model.layers:
        smp.set_activation_checkpointing(layer)
model = smp.DistributedModel(model)
scaling = {}
if args.loss_scale:
    kind, value = args.loss_scale.split(":")
    scaling = ({"static_loss_scale": float(value)} if kind == "static" else
               {"static_loss_scale": None, "dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": float(value)}})
optimizer = smp.DistributedOptimizer(make_optimizer(args.optimizer, model.parameters()), **scaling)
if args.resume:  # before the first step: the model is not cut into stages yet
    smp.resume_from_checkpoint(args.ckpt_dir)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


@smp.step
def train_step_lm(model, data, target):
    # the public templates call the model without use_cache= (GPT-Neo's config keeps it on)
    logits = (model(input_ids=data) if args.model in ("gptneo", "gptj") else model(input_ids=data, use_cache=False))["logits"]
    # labels= would reach only the first stage: the shifted LM loss is computed here
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, data):
    return model(data)


def evaluate(data):
    """Forward-only schedule between training steps (train -> eval -> train), outputs on every rank."""
    model.eval()
    with torch.no_grad():
        out = eval_step(model, data).concat().tolist()
    model.train()
    return out


B = args.per_rank_batch
eval_out = eval_in = None
losses, mb_losses, outputs_shape = [], [], None
scales, overflows, checksums, grad_norms = [], [], [], []
saved_state = None
model.train()
for step in range(args.first_step, args.first_step + args.steps):
    data, target = batch(args.model, step, B * smp.dp_size())
    data, target = data[smp.dp_rank() * B:(smp.dp_rank() + 1) * B], target[smp.dp_rank() * B:(smp.dp_rank() + 1) * B]
    if step == 1 and args.model not in LM_MODELS:
        eval_in, eval_out = data.tolist(), evaluate(data)  # weights after step 0
    optimizer.zero_grad()
    if args.model in LM_MODELS:
        loss_mb = train_step_lm(model, data, target)
    else:
        output_mb, loss_mb = train_step(model, data, target)
        outputs_shape = list(output_mb.concat().shape)
    loss = loss_mb.reduce_mean()
    scales.append(optimizer.loss_scale)
    if args.clip is not None and (args.clip_with == "torch" or (args.clip_with == "both" and step % 2)):
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # a plain script's (and the Trainer's) clip
    elif args.clip is not None:
        optimizer.clip_master_grads(args.clip)
    optimizer.step()
    overflows.append(optimizer.overflow)
    if args.clip is not None:  # the global norm before clipping (DeepSpeed's attribute, engine.ClippingRecord)
        grad_norms.append(float(optimizer._global_grad_norm))
    checksums.append(float(sum(p.detach().double().sum() for p in model.local_parameters())))
    mb_losses.append([float(x) for x in loss_mb.outputs])
    # mean over the data-parallel readers = the loss of the global batch
    losses.append(sum(smp.allgather(float(loss), smp.WORLD)) / smp.size())
    if step + 1 == args.save_at:
        smp.save_checkpoint(args.ckpt_dir, tag=f"step{step + 1}", partial=True, user_content={"step": step + 1})
        if args.final_state:  # what the checkpoint holds (gathered over the stages)
            saved_state = {k: v.tolist() for k, v in model.state_dict().items()}

roundtrip = None
if args.resume:  # smp.save(model.local_state_dict()) -> clobber the weights -> model.load_state_dict(smp.load(...))
    before = {k: v.clone() for k, v in model.local_state_dict().items() if torch.is_tensor(v)}
    smp.save(model.local_state_dict(), os.path.join(args.ckpt_dir, "local.pt"), partial=True)
    with torch.no_grad():
        for p in model.local_parameters():
            p.zero_()
    model.load_state_dict(smp.load(os.path.join(args.ckpt_dir, "local.pt"), partial=True))
    after = model.local_state_dict()
    roundtrip = sorted(before) == sorted(k for k in after if torch.is_tensor(after[k])) and all(
        torch.equal(before[k], after[k]) for k in before)

mixed = optimizer.mixed_precision  # fp16/bf16: the optimizer's state is keyed by the fp32 masters
master = dict(zip(map(id, mixed.params), mixed.masters)) if mixed is not None else {}
local_bytes = sum(p.numel() * p.element_size() for p in model.local_parameters())
state = model.state_dict()
write_result({"eval_out": eval_out, "eval_in": eval_in, "losses": losses, "mb_losses": mb_losses, "outputs_shape": outputs_shape, "pp_rank": smp.pp_rank(),
              "local_bytes": local_bytes, "local_names": [n for n, _ in model.local_named_parameters()],
              "dp_size": smp.dp_size(), "partitioned": model.partitioned, "roundtrip": roundtrip,
              "state_names": [n for n, p in model.local_named_parameters() if optimizer.state.get(master.get(id(p), p))],
              "rdp_rank": smp.rdp_rank(), "scales": scales, "overflows": overflows, "checksums": checksums, "grad_norms": grad_norms,
              "param_dtypes": sorted({str(p.dtype) for p in model.local_parameters()}),
              "saved_state": saved_state, "final_state": {k: v.tolist() for k, v in state.items()} if args.model not in LM_MODELS or args.final_state else None})
