"""Every model family mapped for tensor parallelism, built in turn under delayed parameter
initialisation at tp 2 x sdp 2 (4 ranks), compared tensor by tensor right after smp.DistributedModel
with the same model built without delayed initialisation (plain, same seed, on every rank); the
delayed-init model is created with each rank seeded by its dp rank, as the spec advises.

One job for all families (one rank start-up): smp.init / smp.shutdown per family over a process
group the script owns. Each rank gathers its ZeRO-3 shards (GatheredParameters) and reports, per
tensor, what it found against the reference. The TP ranks' pieces of a split tensor are put back
together first (all-gathered over the TP group), so whole tensors are compared: buffers and
constant-initialised tensors (LayerNorm weights 1, biases 0) equal; tensors that are not split equal
on every TP rank; randomly initialised ones finite, with the reference's standard deviation and mean,
and the two TP pieces of a split one different (the two paths draw random numbers in another order:
transformers' ZeRO-3 init skips the constructors' default init, so values cannot match bitwise)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import write_result  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smp_adapter.runtime.init import shutdown  # noqa: E402


CALLED_DIRECTLY = ("gpt2", "bert", "t5")


def configs():
    import transformers as tf

    common = dict(vocab_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    llama_like = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **common)
    encoder = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=64, num_labels=4, type_vocab_size=2, pad_token_id=1)
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **common)),
        "gptj": (tf.GPTJForCausalLM, tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64,
                                                   tie_word_embeddings=False, **common)),
        "gptneo": (tf.GPTNeoForCausalLM, tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4,
                                                         max_position_embeddings=64, window_size=4,
                                                         attention_types=[[["global", "local"], 1]], **common)),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                             num_attention_heads=4, max_position_embeddings=64,
                                                             **common)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**llama_like)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**llama_like)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(tie_word_embeddings=True, **llama_like)),
        "bert": (tf.BertForSequenceClassification, tf.BertConfig(**encoder)),
        "roberta": (tf.RobertaForSequenceClassification, tf.RobertaConfig(**encoder)),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(image_size=16, patch_size=4, hidden_size=32,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=64, num_labels=4)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                          feed_forward_proj="gated-gelu")),
        "falcon": (tf.FalconForCausalLM, tf.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                         **common)),
    }


def gathered(module):
    """name -> this rank's full (tensor-parallel-local) tensor: ZeRO-3 shards gathered."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        out = {n: p.detach().float().clone() for n, p in params.items()}
    out.update({n: b.detach().float().clone() for n, b in module.named_buffers()})
    return out


def tp_pieces(got):
    """name -> the tensor of every TP rank, in TP-rank order (gathered over the TP group)."""
    pieces = [None] * smp.tp_size()
    dist.all_gather_object(pieces, got, group=smp.get_tp_process_group())
    return {name: [p[name] for p in pieces] for name in got}


def whole(pieces, ref):
    """(the reference as the pieces lay it out, the TP ranks' pieces put back together or None when
    not split), or (None, None). GPT-2's Conv1D weights become Megatron linears, stored transposed;
    the pieces are concatenated along the one dimension they split. Attention weights split per head
    come back in another row order, which no statistic below depends on."""
    for target in [ref] + ([ref.t()] if ref.dim() == 2 else []):
        if pieces[0].shape == target.shape:
            return target, None
        for d in range(target.dim()):
            if sum(p.shape[d] for p in pieces) == target.shape[d]:
                return target, torch.cat(pieces, dim=d)
    return None, None


def compare(reference, got, pieces):
    """Problems, per tensor name, of ``got`` (delayed init, maybe a TP slice) against ``reference``.
    ``pieces``: every TP rank's tensor of that name."""
    problems = []
    ref_params = dict(reference.named_parameters())
    ref_buffers = dict(reference.named_buffers())
    for name, ref in {**ref_params, **ref_buffers}.items():
        ref = ref.detach().float()
        if name not in got:
            problems.append(f"{name}: missing")
            continue
        value = got[name]
        if not torch.isfinite(value).all():
            problems.append(f"{name}: not finite")
            continue
        target, full = whole(pieces[name], ref)
        if target is None:
            problems.append(f"{name}: TP pieces {[tuple(p.shape) for p in pieces[name]]} do not make {tuple(ref.shape)}")
            continue
        if full is None and any(not torch.equal(p, value) for p in pieces[name]):
            # a replicated tensor must start equal on every TP rank, or the ranks train different models
            problems.append(f"{name}: differs between tensor-parallel ranks")
        x = value if full is None else full
        if name in ref_buffers or ref.min() == ref.max():
            # a buffer, or a constant init (ones, zeros): equal, the TP pieces put back included
            if not torch.equal(x, target):
                problems.append(f"{name}: differs from the reference (max {float((x - target).abs().max())})")
        elif ref.numel() > 16:
            # random init: the two paths draw in another order, so the whole tensor's statistics are
            # compared with the reference's: std within 30 % (a sample std of n draws is off by about
            # 1/sqrt(2n) relative, 6 % at n = 128), mean within
            # 6 standard errors of the difference of two sample means (false alarm < 1e-8 per tensor)
            ratio = float(x.std() / ref.std())
            se = float((x.var() / x.numel() + ref.var() / ref.numel()).sqrt())
            if not 0.7 < ratio < 1.4:
                problems.append(f"{name}: std {float(x.std()):.4g} vs reference {float(ref.std()):.4g}")
            elif abs(float(x.mean() - ref.mean())) > 6 * se:
                problems.append(f"{name}: mean {float(x.mean()):.4g} vs reference {float(ref.mean()):.4g}")
            if full is not None and torch.equal(pieces[name][0], pieces[name][1]):
                problems.append(f"{name}: both TP ranks hold the same piece")
    return problems


def main():
    dist.init_process_group("gloo")
    import transformers

    transformers.logging.set_verbosity_error()
    families = sys.argv[1].split(",") if len(sys.argv) > 1 else list(configs())
    results = {}
    for family in families:
        cls, config = configs()[family]
        smp.init({"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True,
                  "delayed_parameter_initialization": True})
        torch.manual_seed(1234)
        reference = cls(config)  # no delayed init: every rank builds the whole model
        # seeded with the dp rank, as the spec advises (§3.5): the TP ranks draw different numbers,
        # and what is not split must still start equal on every TP rank
        torch.manual_seed(1234 + smp.dp_rank())
        with smp.model_creation(tensor_parallelism=True):
            # the class called directly (its own init runs on empty shards) and from_config (transformers'
            # ZeRO-3 path): both must end initialised
            model = cls(config) if family in CALLED_DIRECTLY else cls._from_config(config)
        model = smp.DistributedModel(model)
        got = gathered(model.get_module())
        results[family] = compare(reference, got, tp_pieces(got))
        shutdown()
    write_result({"problems": results})
    dist.barrier()
    dist.destroy_process_group()


main()
