"""Delayed parameter initialisation (runtime/deferred_init.py): a model created under the record
has no storage, and what is materialised equals, to the bit, what the same code gives without
delaying (the reference: the same constructor run normally after the same torch.manual_seed)."""

import ctypes
import ctypes.util
import gc

import psutil
import pytest
import torch
from torch import nn

from smp_adapter.runtime.deferred_init import (
    DeferredInit, DeferredTensor, RecordingError, materialize_in_place, module_tensors)


class Hand(nn.Module):
    """Parameters initialised in the ways scripts do it by hand."""

    def __init__(self):
        super().__init__()
        self.scaled = nn.Parameter(torch.randn(5, 7) * 0.02)  # an expression of a random factory
        self.linear = nn.Linear(7, 9)  # reset_parameters: kaiming_uniform_ + uniform_
        self.embedding = nn.Embedding(11, 7, padding_idx=0)  # normal_, then a row zeroed through a view
        self.register_buffer("positions", torch.arange(10).expand(1, -1))
        self.register_buffer("causal", torch.tril(torch.ones(4, 4)))
        self.literal = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))  # a literal stays a real tensor
        with torch.no_grad():
            self.linear.weight[0].zero_()
        nn.init.trunc_normal_(self.scaled, std=0.1)  # a rejection loop that reads values (any())
        self.orthogonal = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.orthogonal)  # QR of a random matrix
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm1d(4)
        g = torch.Generator().manual_seed(5)
        self.own_generator = nn.Parameter(torch.rand(3, 3, generator=g))
        # a value read while creating (timm/Hugging Face drop-path rates)
        self.rates = [x.item() for x in torch.linspace(0, 0.1, 4)]
        # a tensor held as a plain attribute, neither parameter nor buffer (transformers 4.x GPT-J's
        # rotary table, embed_positions): it needs values as much as a buffer does
        self.table = torch.outer(torch.arange(6.0), 1.0 / (100 ** (torch.arange(0, 4, 2) / 4.0)))


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


def _tiny_bert():
    from transformers import BertConfig, BertForPreTraining

    return BertForPreTraining(BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, vocab_size=100, max_position_embeddings=32))


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                               vocab_size=100, decoder_start_token_id=0, pad_token_id=0))


def _tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, image_size=16, patch_size=4, num_labels=3))


def _bf16_mlp():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # smp.model_creation(dtype=torch.bfloat16) does this
    try:
        return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    finally:
        torch.set_default_dtype(previous)


BUILDERS = {"hand": Hand, "gpt2": _tiny_gpt2, "llama": _tiny_llama, "bert": _tiny_bert, "t5": _tiny_t5,
            "vit": _tiny_vit, "bf16": _bf16_mlp}


def _named(module) -> dict:
    """Parameters, buffers and the tensors held as plain attributes, by name."""
    attributes = {f"{name}.{key}" if name else key: v for name, m in module.named_modules()
                  for key, v in vars(m).items() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)}
    return {**dict(module.named_parameters()), **dict(module.named_buffers()), **attributes}


def _created(build, seed=0):
    torch.manual_seed(seed)
    record = DeferredInit()
    with record.creating():
        model = build()
    return model, record


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_materialised_values_equal_the_undelayed_model(name):
    build = BUILDERS[name]
    torch.manual_seed(0)
    reference = build()
    after_reference = torch.rand(4)  # the generator advanced as the creation would have
    model, record = _created(build)
    assert torch.equal(torch.rand(4), after_reference)
    deferred = [t for t in module_tensors(model) if isinstance(t, DeferredTensor)]
    assert deferred, "nothing was delayed"
    assert not any(t.is_meta for t in deferred) and all(t.device.type == "cpu" for t in deferred)
    materialize_in_place(record, module_tensors(model), "cpu")
    want = _named(reference)
    got = _named(model)
    assert sorted(got) == sorted(want)
    for key, tensor in got.items():
        assert not isinstance(tensor, DeferredTensor), f"{key} was left without storage"
        assert type(tensor) is type(want[key]) or isinstance(tensor, nn.Parameter) == isinstance(want[key], nn.Parameter)
        assert tensor.dtype == want[key].dtype and torch.equal(tensor, want[key]), key


def test_tied_weights_stay_tied_and_objects_keep_their_identity():
    model, record = _created(_tiny_gpt2)
    wte, head = model.transformer.wte.weight, model.lm_head.weight
    assert wte is head
    optimizer_holds = list(model.parameters())
    materialize_in_place(record, module_tensors(model), "cpu")
    assert type(wte) is nn.Parameter and model.lm_head.weight is model.transformer.wte.weight
    assert [id(p) for p in model.parameters()] == [id(p) for p in optimizer_holds]


def _trimmed_rss() -> int:
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def test_only_what_is_materialised_gets_storage():
    """16 layers of 4 MiB: creating them allocates one layer's scratch at a time, and materialising
    one layer allocates that layer (and what it was computed from), not the model. Resident memory
    after the C library returned its free heap: what is in use (test_pipeline_memory.py measures whole jobs)."""
    _created(lambda: nn.Linear(4, 4))  # the code recording runs is loaded before the baseline
    baseline = _trimmed_rss()
    model, record = _created(lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)]))
    assert _trimmed_rss() - baseline < 12 * 2**20  # (the model is 64 MiB)
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    del reference[:7], reference[1:]
    materialize_in_place(record, module_tensors(model[7]), "cpu")
    assert torch.equal(model[7].weight, reference[0].weight) and torch.equal(model[7].bias, reference[0].bias)
    assert isinstance(model[6].weight, DeferredTensor) and isinstance(model[8].weight, DeferredTensor)
    del reference
    assert _trimmed_rss() - baseline < 12 * 2**20


def test_operations_after_creation_are_recorded_too():
    """A cast (the pipeline engine's fp16/bf16 model) and a change made by the script after the
    context closed are part of the value."""
    model, record = _created(lambda: nn.Linear(6, 6))
    with torch.no_grad():
        model.weight.mul_(2)
    model.to(torch.float16)
    torch.manual_seed(0)
    reference = nn.Linear(6, 6)
    with torch.no_grad():
        reference.weight.mul_(2)
    reference.to(torch.float16)
    materialize_in_place(record, module_tensors(model), "cpu")
    assert model.weight.dtype == torch.float16 and torch.equal(model.weight, reference.weight)


def test_random_states_of_another_rank_give_that_ranks_values():
    """Data-parallel ranks seeded differently replay their group's first rank's draws."""
    first, first_record = _created(lambda: nn.Linear(5, 5), seed=1)
    other, other_record = _created(lambda: nn.Linear(5, 5), seed=2)
    other_record.adopt_random_states(first_record.random_states())
    materialize_in_place(first_record, module_tensors(first), "cpu")
    materialize_in_place(other_record, module_tensors(other), "cpu")
    assert torch.equal(first.weight, other.weight) and torch.equal(first.bias, other.bias)
    _, short = _created(lambda: nn.Linear(5, 5, bias=False), seed=2)
    with pytest.raises(RecordingError, match="same model the same way"):
        short.adopt_random_states(first_record.random_states())


def test_a_meta_tensor_made_by_the_script_is_refused_with_the_fix():
    record = DeferredInit()
    with torch.device("meta"):
        stray = nn.Linear(3, 3)
    with pytest.raises(RecordingError, match="delay_param_initialization"):
        record.materialize([stray.weight], "cpu")


def test_a_constant_changed_after_it_was_copied_in_is_refused():
    source = torch.ones(4)
    record = DeferredInit()
    with record.creating():
        target = torch.empty(4)
        target.copy_(source)
    source.add_(1)
    with pytest.raises(RecordingError, match="changed afterwards"):
        record.materialize([target], "cpu")


def test_gradient_hooks_stay_with_the_parameter():
    """Tensor parallelism scales a split weight's gradient with a hook registered before the model
    is materialised: it must still run after (seen: 2x gradients at tp 2 when it was lost)."""
    model, record = _created(lambda: nn.Linear(3, 3))
    model.weight.register_hook(lambda g: g * 0.5)
    seen = []
    model.bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    materialize_in_place(record, module_tensors(model), "cpu")
    torch.manual_seed(0)
    reference = nn.Linear(3, 3)
    x = torch.ones(2, 3)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(model.weight.grad, 0.5 * reference.weight.grad)
    assert len(seen) == 1 and torch.equal(seen[0], reference.bias.grad)


def test_the_record_is_released_with_the_last_delayed_tensor():
    """A pipeline rank materialises its stage and turns the rest into meta tensors; the creation
    record, and what it refers to (weights loaded into the model before the first step), must then
    go, or every rank would keep the whole loaded model alive."""
    import weakref

    from smp_adapter.runtime.deferred_init import meta_like, record_of, replace_in_place

    model, record = _created(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    loaded = {k: torch.ones_like(v) for k, v in nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).state_dict().items()}
    model.load_state_dict(loaded)  # recorded: a copy from each loaded tensor
    watch, first_loaded = weakref.ref(record), weakref.ref(loaded["0.weight"])
    assert record_of(model) is record
    del record, loaded
    materialize_in_place(record_of(model), module_tensors(model[0]), "cpu")
    for t in module_tensors(model[1]):
        replace_in_place(t, meta_like(t))  # another stage's
    assert torch.equal(model[0].weight, torch.ones(4, 4)) and model[1].weight.is_meta
    gc.collect()
    assert watch() is None and first_loaded() is None
