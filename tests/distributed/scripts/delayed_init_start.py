"""Delayed parameter initialisation starts from the weights one process creates without delaying.

For each layout given (argv[1]: comma-separated names of LAYOUTS) and each model variant (VARIANTS:
GPT-2 and a Llama, tied and untied embeddings, created by calling the class directly inside
smp.delay_param_initialization() or through smp.model_creation() + from_config; every variant on
the ZeRO-3 engine's layouts, whose creation path is its own, and the two tied ones on MiCS, pp 2 and
tp 2, which share the whole-tensor engines' record), every rank:
seeds torch with 1234 + its dp rank (the spec's advice; the job must still start from one model),
creates the model under delayed initialisation, wraps it, and trains STEPS steps of SGD on a fixed
global batch split over the replicas. The reference is plain PyTorch in this same process: the model
created with seed 1234 and no smp, the whole global batch, the same SGD. Each rank reports both
loss sequences; the test compares them.

One job for every layout and variant (smp.init / shutdown each time, over a process group the
script owns): a rank's start-up costs more than a tiny model's steps."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smp_adapter.runtime.init import shutdown  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, LR = 2, 8, 16, 128, 0.5
# sharded data parallel clips at 1.0 by default (smp v1's sdp_gradient_clipping); off, so that the
# steps after the first compare the gradients themselves with the one-process run's
NO_CLIP = {"sdp_gradient_clipping": 0.0}
LAYOUTS = {
    "zero3": {"ddp": True, "sharded_data_parallel_degree": 0, **NO_CLIP},  # sdp = the world (set below)
    "hpz": {"ddp": True, "sharded_data_parallel_degree": 2, **NO_CLIP},  # SMP_ADAPTER_SDP_ENGINE=hpz (set below)
    "mics": {"ddp": True, "sharded_data_parallel_degree": 2, **NO_CLIP},
    "pp2": {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2},
    "tp2": {"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True},
}
VARIANTS = tuple(os.environ.get("DELAYED_INIT_VARIANTS", "gpt2-tied-direct,gpt2-untied-model_creation,"
                                "llama-tied-model_creation,llama-untied-direct").split(","))


def config(variant):
    import transformers as tf

    family, tying, _ = variant.split("-")
    tied = tying == "tied"
    if family == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                                                 tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0)
    return tf.LlamaForCausalLM, tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                               max_position_embeddings=SEQ, tie_word_embeddings=tied)


def create(variant):
    cls, cfg = config(variant)
    if variant.endswith("plain"):  # not delayed: what the delayed ones must equal on this layout too
        return cls(cfg)
    if variant.endswith("model_creation"):
        with smp.model_creation():
            return cls._from_config(cfg)
    with smp.delay_param_initialization(enabled=True):
        return cls(cfg)


def batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference_losses(variant):
    cls, cfg = config(variant)
    torch.manual_seed(1234)
    model = cls(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def smp_losses(variant):
    torch.manual_seed(1234 + smp.dp_rank())
    model = smp.DistributedModel(create(variant))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    per_replica = BATCH // smp.rdp_size()
    losses = []
    for ids in batches():
        rows = ids[smp.rdp_rank() * per_replica:(smp.rdp_rank() + 1) * per_replica]
        opt.zero_grad()
        loss = train_step(model, rows).reduce_mean().detach().clone()
        opt.step()
        dist.all_reduce(loss, group=smp.get_rdp_process_group())  # the replicas' rows make the global batch
        losses.append(loss.item() / smp.rdp_size())
    return losses


def smp_adapter_engine():
    from smp_adapter.runtime.state import state

    return f"{state.dims.engine}, ZeRO stage {state.dims.zero_stage}, hpZ partition {state.dims.hpz_partition_size}"


def main():
    dist.init_process_group("gloo")
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    for layout in sys.argv[1].split(","):
        for variant in VARIANTS if layout in ("zero3", "hpz") else VARIANTS[::2]:
            options = dict(LAYOUTS[layout], delayed_parameter_initialization=True)
            if layout == "zero3":
                options["sharded_data_parallel_degree"] = dist.get_world_size()
            os.environ.pop("SMP_ADAPTER_SDP_ENGINE", None)
            if layout == "hpz":
                os.environ["SMP_ADAPTER_SDP_ENGINE"] = "hpz"  # read by smp.init
            smp.init(options)
            results[f"{layout}/{variant}"] = {"engine": smp_adapter_engine(), "smp": smp_losses(variant),
                                              "reference": reference_losses(variant)}
            shutdown()
    write_result({"losses": results})
    dist.barrier()
    dist.destroy_process_group()


main()
