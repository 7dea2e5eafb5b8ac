"""Tensor-parallel marking and replacement decisions (smp_adapter.parallel), without a process group.

Replacement decisions are checked with a TPContext that has a size but no group: modules are
built and swapped in, but nothing runs a collective (forward passes here go through user modules
that do not communicate).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from smp_adapter.errors import NotInitializedError, SMPCheckpointError, SMPUsageError, UnsupportedFeatureError
from smp_adapter.parallel import marking
from smp_adapter.parallel.marking import (get_mark, set_tensor_parallelism, tensor_parallelism, tp_register,
                                          tp_register_with_module)
from smp_adapter.parallel.tensor import (TPContext, apply_tensor_parallelism, current_tp_context,
                                         is_distributed_parameter, set_current_tp_context)


def fake_ctx(size=2, rank=0, prescaled=False):
    return TPContext(group=None, rank=rank, size=size, prescaled_batch=prescaled)


@pytest.fixture(autouse=True)
def clean_state():
    orig_init = nn.Module.__init__
    yield
    set_current_tp_context(None)
    assert nn.Module.__init__ is orig_init, "a tensor_parallelism context leaked its Module.__init__ patch"
    assert not marking._stack


def split(model, size=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = apply_tensor_parallelism(model, fake_ctx(size))
    return names, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)


# ---------------------------------------------------------------- marking


def test_innermost_context_wins():
    with tensor_parallelism():
        a = nn.Linear(4, 4)
        with tensor_parallelism(enabled=False):
            b = nn.Linear(4, 4)
            with tensor_parallelism(fused_softmax=False):
                c = nn.Linear(4, 4)
        d = nn.Linear(4, 4)
    e = nn.Linear(4, 4)
    assert get_mark(a).enabled and get_mark(d).enabled
    assert not get_mark(b).enabled
    assert get_mark(c).enabled and get_mark(c).kwargs == {"fused_softmax": False}
    assert get_mark(e) is None


def test_children_are_marked_by_their_creation_context():
    with tensor_parallelism():
        two = Two()
    assert all(get_mark(m).enabled for m in (two, two.a, two.b))
    two.c = nn.Linear(8, 8)  # created after the context: not marked
    assert get_mark(two.c) is None


def test_context_restores_module_init_on_error():
    orig = nn.Module.__init__
    with pytest.raises(RuntimeError, match="boom"):
        with tensor_parallelism():
            raise RuntimeError("boom")
    assert nn.Module.__init__ is orig


def test_set_tensor_parallelism_disables_a_subtree():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = Two()
            self.dec = Two()

    with tensor_parallelism():
        net = Net()
    set_tensor_parallelism(net.dec, False)
    assert not get_mark(net.dec.a).enabled and not get_mark(net.dec.b).enabled
    names, warns = split(net)
    assert names == ["enc.a", "enc.b"] and warns == []
    assert isinstance(net.dec.a, nn.Linear) and type(net.enc.a).__name__ == "DistributedLinear"


def test_set_tensor_parallelism_after_creation_and_later_calls_win():
    net = Two()
    set_tensor_parallelism(net, True)
    set_tensor_parallelism(net.b, False)
    names, _ = split(net)
    assert names == ["a"]
    with pytest.raises(SMPUsageError, match="after smp.DistributedModel split the model"):
        set_tensor_parallelism(net, True)
    with pytest.raises(SMPUsageError, match="expects a torch.nn.Module"):
        set_tensor_parallelism("fc1")


def test_unmarked_model_is_untouched_and_tp1_is_a_no_op():
    net = Two()
    assert split(net) == ([], [])
    with tensor_parallelism():
        net = Two()
    assert apply_tensor_parallelism(net, TPContext(None, 0, 1)) == []
    assert isinstance(net.a, nn.Linear)


def test_split_weights_are_slices_of_the_original():
    with tensor_parallelism():
        net = Two()
    wa, ba = net.a.weight.detach().clone(), net.a.bias.detach().clone()
    apply_tensor_parallelism(net, fake_ctx(2, rank=1))
    assert torch.equal(net.a.weight, wa[:, 4:]) and torch.equal(net.a.bias, ba)  # input dim split
    assert is_distributed_parameter(net.a.weight) and not is_distributed_parameter(net.a.bias)


# ---------------------------------------------------------------- modules left whole


def test_non_divisible_sizes_stay_whole_with_a_warning():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(30, 8)
            self.emb = nn.Embedding(10, 4)
            self.ok = nn.Linear(32, 10)

    with tensor_parallelism():
        net = Net()
    names, warns = split(net, size=4)
    assert names == ["ok"]
    assert ("tensor parallelism: fc (Linear) is not distributed and stays whole on every rank: "
            "in_features=30 is not divisible by the tensor-parallel degree 4") in warns
    assert ("tensor parallelism: emb (Embedding) is not distributed and stays whole on every rank: "
            "num_embeddings=10 is not divisible by the tensor-parallel degree 4") in warns
    assert isinstance(net.fc, nn.Linear) and isinstance(net.emb, nn.Embedding)


def test_shared_weights_stay_whole_with_a_warning():
    with tensor_parallelism():
        net = Two()
        net.c = nn.Linear(8, 8)
    net.c.weight = net.a.weight
    names, warns = split(net)
    assert names == ["b"]
    assert "tensor parallelism: a (Linear) is not distributed and stays whole on every rank: " \
           "it shares parameters with c" in warns
    assert "tensor parallelism: c (Linear) is not distributed and stays whole on every rank: " \
           "it shares parameters with a" in warns


def test_hf_sizes_not_divisible_stay_whole_with_warnings():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=6, n_head=3, n_inner=6, vocab_size=66, n_positions=18)
    with tensor_parallelism():
        model = transformers.GPT2LMHeadModel(cfg)
    names, warns = split(model, size=4)
    assert names == []
    prefix = "tensor parallelism: {} is not distributed and stays whole on every rank: "
    attn = type(model.transformer.h[0].attn).__name__  # GPT2SdpaAttention in transformers 4.41-4.47
    assert (prefix.format(f"transformer.h.0.attn ({attn})")
            + "num_attention_heads=3 is not divisible by the tensor-parallel degree 4") in warns
    assert (prefix.format("transformer.h.0.mlp (GPT2MLP)")
            + "c_fc has 6 output features, not divisible by 1 x 4") in warns
    assert (prefix.format("transformer.wte (Embedding)")
            + "the vocabulary (66) is not divisible by the tensor-parallel degree 4") in warns
    assert (prefix.format("lm_head (Linear)")  # tied to wte: both stay whole, one reason
            + "the vocabulary (66) is not divisible by the tensor-parallel degree 4") in warns
    assert len(warns) == 5 and any("transformer.wpe" in w for w in warns)  # no duplicate warnings
    assert model.transformer.h[0].attn.num_heads == 3
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tp_context_must_match_the_group():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with tensor_parallelism():
        model = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64))
    with pytest.raises(RuntimeError, match="TPContext says tp_size=2 but the process group has None ranks"):
        apply_tensor_parallelism(model, fake_ctx(2))


# ---------------------------------------------------------------- tp_register


def _make_registered():
    from smp_adapter.parallel.nn import DistributedModule

    class ScaledDist(DistributedModule):
        def __init__(self, dim, scale=1.0):
            super().__init__()
            self.dim, self.scale = dim, scale
            self.lin = nn.Linear(dim, dim)
            self.seen_tp = self.tp_size

        def forward(self, x, shift):
            return (self.lin(x) + shift) * self.scale, "debug"

    calls = []

    def init_hook(dim, bias=True):
        calls.append(("init", dim, bias))
        return (dim,), {"scale": 3.0}

    def forward_hook(x, shift=None):
        return (x,), {"shift": 0.0 if shift is None else shift}

    @tp_register(ScaledDist, init_hook=init_hook, forward_hook=forward_hook, return_hook=lambda out: out[0])
    class Block(nn.Module):
        def __init__(self, dim, bias=True):
            super().__init__()
            self.lin = nn.Linear(dim, dim, bias=bias)

        def forward(self, x, shift=None):
            return self.lin(x)

    return Block, ScaledDist, calls


def test_tp_register_replaces_with_hooks():
    Block, ScaledDist, calls = _make_registered()
    try:
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Block(4, bias=False)

        with tensor_parallelism(scale=5.0, fused_softmax=True):  # scale matches ScaledDist.__init__
            net = Net()
        names, warns = split(net)
        assert names == ["block"] and warns == []
        assert calls == [("init", 4, False)]
        assert isinstance(net.block, ScaledDist) and net.block.scale == 5.0 and net.block.seen_tp == 2
        out = net.block(torch.ones(1, 4), shift=1.0)
        assert isinstance(out, torch.Tensor)  # return_hook dropped the "debug" entry
        torch.testing.assert_close(out, (net.block.lin(torch.ones(1, 4)) + 1.0) * 5.0)
    finally:
        marking.unregister(Block)


def test_tp_register_init_hook_may_decline():
    from smp_adapter.parallel.nn import DistributedModule

    class Dist(DistributedModule):
        def __init__(self, dim):
            super().__init__()

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim)

    tp_register_with_module(Block, Dist, init_hook=lambda dim: None if dim == 3 else ((dim,), {}))
    try:
        with tensor_parallelism():
            small, big = Block(3), Block(4)
        container = nn.ModuleDict({"small": small, "big": big})
        names, warns = split(container)
        assert names == ["big"] and warns == []
        assert container["small"] is small and isinstance(container["big"], Dist)
    finally:
        marking.unregister(Block)


def test_tp_register_validates_hooks_and_classes():
    from smp_adapter.parallel.nn import DistributedModule

    class Dist(DistributedModule):
        pass

    class Block(nn.Module):
        def __init__(self, dim, bias=True):
            super().__init__()

        def forward(self, x):
            return x

    with pytest.raises(SMPUsageError, match=r"signature of init_hook \(dim\) must exactly match Block.__init__ "
                                            r"without self \(dim, bias\)"):
        tp_register_with_module(Block, Dist, init_hook=lambda dim: ((dim,), {}))
    with pytest.raises(SMPUsageError, match=r"signature of forward_hook \(y\) must exactly match Block.forward"):
        tp_register_with_module(Block, Dist, forward_hook=lambda y: ((y,), {}))
    with pytest.raises(SMPUsageError, match="must be a subclass of smp.nn.DistributedModule"):
        tp_register(nn.Linear)(Block)
    assert marking.registration_for(Block(2)) is None


def test_instances_created_before_registration_stay_whole():
    from smp_adapter.parallel.nn import DistributedModule

    class Dist(DistributedModule):
        def __init__(self, dim):
            super().__init__()

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim)

    with tensor_parallelism():
        net = nn.Sequential(Block(4))
    tp_register_with_module(Block, Dist)
    try:
        names, warns = split(net)
        assert names == []
        assert any("registered with smp.tp_register after the instance was created" in w for w in warns)
    finally:
        marking.unregister(Block)


# ---------------------------------------------------------------- smp.nn without smp.init


def test_smp_nn_modules_need_init():
    from smp_adapter.parallel.nn import DistributedEmbedding, DistributedLinear, DistributedTransformerLayer

    assert current_tp_context() is None
    for build in (lambda: DistributedLinear(4, 4), lambda: DistributedEmbedding(8, 4),
                  lambda: DistributedTransformerLayer(num_attention_heads=2, attention_head_size=2, hidden_size=4,
                                                      intermediate_size=8)):
        with pytest.raises(NotInitializedError, match=r"needs the tensor-parallel group: call smp.init\(\)"):
            build()


def test_smp_nn_size_checks_and_unsupported_features():
    from smp_adapter.parallel.nn import DistributedEmbedding, DistributedLinear, DistributedTransformerLMHead

    set_current_tp_context(fake_ctx(2))
    with pytest.raises(SMPUsageError, match="in_features=5 is not divisible by the tensor-parallel degree 2"):
        DistributedLinear(5, 4)
    with pytest.raises(UnsupportedFeatureError, match="max_norm"):
        DistributedEmbedding(8, 4, max_norm=1.0)
    with pytest.raises(SMPUsageError, match=r"vocab_size=31 is not divisible by the tensor-parallel degree 2: pad "
                                            r"the vocabulary"):
        DistributedTransformerLMHead(vocab_size=31)
    lin = DistributedLinear(6, 3)
    assert tuple(lin.weight.shape) == (3, 3) and is_distributed_parameter(lin.weight)


# ---------------------------------------------------------------- shard layouts and translation


def test_shard_layout_round_trip_fused_and_transposed():
    from smp_adapter.parallel.layers import ShardLayout

    full = torch.arange(4 * 12.0).view(4, 12)  # a Conv1D-style [in, 3*out] fused q|k|v weight
    layout = ShardLayout(tuple(full.shape), dim=1, parts=3, transposed=True)
    shards = [layout.shard(full, r, 2) for r in range(2)]
    assert tuple(shards[0].shape) == (6, 4)
    assert torch.equal(shards[1].t(), torch.cat([full[:, 2:4], full[:, 6:8], full[:, 10:12]], 1))
    assert torch.equal(layout.unshard(shards), full)


def test_hf_translate_functions_are_validating_identities():
    from smp_adapter.parallel import hf_translate as t

    for family, funcs in t.FAMILY_FUNCTIONS.items():
        for name, fn in funcs.items():
            assert fn.__name__ == name and getattr(t, name) is fn
    # the odd names of spec 5.9 exist
    assert t.translate_hf_gptj_state_dict_to_smdistributed_gptj and t.translate_state_dict_to_smdistributed
    sd = {"module.transformer.h.0.attn.c_attn.weight": torch.zeros(2, 6), "module.transformer.wpe.weight": torch.zeros(8, 2)}
    out = t.translate_state_dict_to_hf_gpt2(sd, max_seq_len=8)
    assert set(out) == {"transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight"} and len(sd) == 2
    with pytest.raises(SMPCheckpointError, match="max_seq_len=9 exceeds the model's 8 positions"):
        t.translate_state_dict_to_hf_gpt2(sd, max_seq_len=9)
    with pytest.raises(SMPCheckpointError, match="does not look like a bert state dict"):
        t.translate_state_dict_to_hf_bert(sd)
    with pytest.raises(SMPCheckpointError, match="partial state dict"):
        t.translate_hf_state_dict_to_smdistributed_gpt2({**sd, "_smp_is_partial": True})
