"""Every model family mapped for tensor parallelism, built in turn under delayed parameter
initialisation at tp 2 x sdp 2 (4 ranks), compared tensor by tensor right after smp.DistributedModel
with the same model built without delayed initialisation (plain, same seed, on every rank).

One job for all families (one rank start-up): smp.init / smp.shutdown per family over a process
group the script owns. Each rank gathers its ZeRO-3 shards (GatheredParameters) and reports, per
tensor, what it found against the reference: buffers must be equal, constant-initialised tensors
(LayerNorm weights 1, biases 0) equal, randomly initialised ones finite, with the reference's
standard deviation (the two paths draw random numbers in another order: transformers' ZeRO-3 init
skips the constructors' default init, so values cannot match bitwise)."""

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


def compare(reference, got):
    """Problems, per tensor name, of ``got`` (delayed init, maybe a TP slice) against ``reference``."""
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
        elif name in ref_buffers or ref.min() == ref.max():
            # a buffer, or a constant init (ones, zeros): equal; a TP slice holds a part of it
            if value.shape == ref.shape:
                if not torch.equal(value, ref):
                    problems.append(f"{name}: differs from the reference (max {float((value - ref).abs().max())})")
            elif not (value.numel() and value.min() == ref.min() and value.max() == ref.max()):
                problems.append(f"{name}: slice does not hold the reference's constant {float(ref.min())}")
        elif ref.numel() > 16:
            ratio = float(value.std() / ref.std())
            if not 0.7 < ratio < 1.4:  # >= 512 draws per tensor: a sample std is within ~10%
                problems.append(f"{name}: std {float(value.std()):.4g} vs reference {float(ref.std()):.4g}")
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
        torch.manual_seed(1234)
        with smp.model_creation(tensor_parallelism=True):
            # the class called directly (its own init runs on empty shards) and from_config (transformers'
            # ZeRO-3 path): both must end initialised
            model = cls(config) if family in CALLED_DIRECTLY else cls._from_config(config)
        model = smp.DistributedModel(model)
        results[family] = compare(reference, gathered(model.get_module()))
        shutdown()
    write_result({"problems": results})
    dist.barrier()
    dist.destroy_process_group()


main()
