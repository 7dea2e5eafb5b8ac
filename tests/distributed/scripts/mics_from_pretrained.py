"""`from_pretrained` under MiCS (sdp 2 of 4 ranks) gives each rank the rows of the saved weights.

Rank 0 saves a GPT-2 (tied embeddings) with save_pretrained, as safetensors and as a `.bin`; then, for each
case, every rank loads it, wraps it in smp.DistributedModel and reports: whether its shards bit-equal its rows
of the weights one process loads eagerly (the reference, modified as the case modifies them), how many
parameters came from the file by pread (runtime/file_backed.py) and by broadcast, and the first loss of the
whole batch against plain PyTorch's on the reference in this process. The `safetensors` and `bin` cases then
train STEPS SGD steps of 2 microbatches beside the reference (`bin` with activation checkpointing on every
block) and report both losses, and the number of FSDP2 units: at n_embd 512
a block holds more than a quarter of a rank's shard at sdp 2, so its attention and its MLP's two
projections (>= 1M elements each) are units of their own (units.sharding_units), 4 units per block.

Cases: `safetensors` (from_pretrained outside smp.model_creation), `bin` (a pytorch_model.bin, inside
smp.model_creation()), `written` (after loading, every rank scales the first block's MLP weight by 2 and its
attention weight by 1 + dp rank: written tensors are no longer the file's, so they must arrive from dp rank 0,
x2 and x1), `full_resume` (a model of other weights, created under delayed init and wrapped, then
smp.resume_from_checkpoint(partial=False) of the full checkpoint the safetensors case saved)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smp_adapter.runtime.init import shutdown  # noqa: E402

SEQ, VOCAB, BATCH, STEPS, LR = 16, 128, 8, 3, 0.1


def save(folder):
    import transformers as tf
    from safetensors.torch import load_file

    torch.manual_seed(5)
    cfg = tf.GPT2Config(n_layer=2, n_embd=512, n_head=4, n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    tf.GPT2LMHeadModel(cfg).save_pretrained(f"{folder}/safetensors")
    os.makedirs(f"{folder}/bin", exist_ok=True)
    cfg.save_pretrained(f"{folder}/bin")
    torch.save(load_file(f"{folder}/safetensors/model.safetensors"), f"{folder}/bin/pytorch_model.bin")


def modify(model, case, dp_rank):
    if case == "written":
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.mul_(2.0)
            model.transformer.h[0].attn.c_attn.weight.mul_(1.0 + dp_rank)


def load(folder, case):
    import transformers as tf

    if case == "full_resume":  # other weights, under delayed init: the resume must replace every one
        torch.manual_seed(99)
        with smp.delay_param_initialization(enabled=True):
            return tf.GPT2LMHeadModel(tf.GPT2Config.from_pretrained(f"{folder}/safetensors"))
    path = f"{folder}/bin" if case == "bin" else f"{folder}/safetensors"
    if case == "bin":
        with smp.model_creation():
            return tf.GPT2LMHeadModel.from_pretrained(path)
    return tf.GPT2LMHeadModel.from_pretrained(path)


def counting(module, name, counts, key):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def run_case(folder, case, ids):
    import transformers as tf

    from smp_adapter.runtime import file_backed
    from smp_adapter.runtime.engines.mics import creation
    from smp_adapter.runtime.engines.mics.shards import shard_rows

    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0, "microbatches": 2})
    counts = {"file": 0, "broadcast": 0}
    read, bcast = counting(file_backed, "read_rows", counts, "file"), counting(creation, "_broadcast_whole", counts, "broadcast")
    try:
        module = load(folder, case)
        modify(module, case, smp.dp_rank())
        model = smp.DistributedModel(module)
        if case == "safetensors":  # the full checkpoint full_resume loads (the merged whole model)
            smp.save_checkpoint(f"{folder}/full", "loaded", partial=False, model=model)
        if case == "full_resume":
            smp.resume_from_checkpoint(f"{folder}/full", tag="loaded", partial=False)
    finally:
        file_backed.read_rows, creation._broadcast_whole = read, bcast
    reference = tf.GPT2LMHeadModel.from_pretrained(f"{folder}/safetensors")
    modify(reference, case, 0)
    ref = dict(reference.named_parameters())
    unequal = [n for n, p in model.module.named_parameters()
               if not torch.equal(p.to_local(), shard_rows(ref[n].detach(), p).to(p.dtype))]
    per = BATCH // smp.rdp_size()
    rows = ids[smp.rdp_rank() * per:(smp.rdp_rank() + 1) * per]
    with torch.no_grad():
        loss = model(input_ids=rows, labels=rows)["loss"].detach().clone()
        reference_loss = reference(input_ids=ids, labels=ids).loss.item()
    dist.all_reduce(loss, group=smp.get_rdp_process_group())
    result = {"unequal": unequal, "counts": counts, "loss": loss.item() / smp.rdp_size(),
              "reference_loss": reference_loss,
              "engine": type(model.runtime_engine).__name__}
    if case in ("safetensors", "bin"):
        if case == "bin":  # a checkpointed block's recompute gathers its units again inside the backward
            for block in model.get_module().transformer.h:
                smp.set_activation_checkpointing(block)
        result.update(train(model, reference, rows, ids), units=len(model.runtime_engine.units))
    shutdown()
    return result


@smp.step
def train_step(model, rows):
    loss = model(input_ids=rows, labels=rows)["loss"]
    model.backward(loss)
    return loss


def train(model, reference, rows, ids):
    """STEPS SGD steps of the MiCS model on this replica's rows, of the reference on the whole batch."""
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    losses, reference_losses = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = train_step(model, rows).reduce_mean().detach().clone()  # this replica's rows: averaged below
        dist.all_reduce(loss, group=smp.get_rdp_process_group())
        losses.append(loss.item() / smp.rdp_size())
        optimizer.step()
        ref_optimizer.zero_grad()
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_optimizer.step()
        reference_losses.append(loss.item())
    return {"losses": losses, "reference_losses": reference_losses}


def main():
    dist.init_process_group("gloo")
    import transformers

    transformers.logging.set_verbosity_error()
    folder = os.environ["SMP_TEST_OUT"] + "/checkpoint"
    if dist.get_rank() == 0:
        save(folder)
    dist.barrier()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    write_result({case: run_case(folder, case, ids) for case in ("safetensors", "bin", "written", "full_resume")})
    dist.barrier()
    dist.destroy_process_group()


main()
