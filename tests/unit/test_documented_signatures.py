"""The smp v1 signatures the public API pages give, to the letter, against the runtime's.

DOCUMENTED is our own table, written from the SageMaker Python SDK's smp v1 pages
(doc/api/training/smp_versions/latest/: smd_model_parallel_common_api.rst, smd_model_parallel_pytorch.rst,
smd_model_parallel_pytorch_tensor_parallel.rst). Each entry is the parameter list as documented:
"name" (positional or keyword, no default given), "name=default" (the documented default), "*args" /
"**kwargs" (the documented catch-alls). The runtime must accept each documented parameter at its
documented position and under its documented name, with the documented default; it may add
parameters of its own after them (smp-adapter extensions, e.g. ``smp.save(v3=)``), never before.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.patches import checkpoint as smp_checkpoint
from smp_adapter.parallel import marking

W = "smp.WORLD"  # a documented default that names an smp object, resolved below

DOCUMENTED = {
    # common API
    "init": [],
    "step": ["non_split_inputs", "input_split_axes", "detach_outputs=True"],
    "StepOutput.reduce_mean": [], "StepOutput.reduce_sum": [], "StepOutput.concat": [], "StepOutput.stack": [],
    "broadcast": ["obj", "group"], "send": ["obj", "dest_rank", "rank_type"], "recv_from": ["src_rank", "rank_type"],
    "allgather": ["obj", "group"], "barrier": [f"group={W}"], "dp_barrier": [], "mp_barrier": [],
    # PyTorch API
    "DistributedModel": ["module", "trace_device='gpu'", "trace_execution_times=False",
                         "overlapping_allreduce=True", "backward_passes_per_step=1",
                         "average_grads_across_microbatches=True", "bucket_cap_mb=25", "trace_memory_usage=False",
                         "broadcast_buffers=True", "gradient_as_bucket_view=False"],
    "DistributedModel.backward": ["tensors", "grad_tensors"],
    "DistributedModel.register_post_partition_hook": ["hook"],
    "DistributedModel.register_comm_hook": ["state", "callable"],
    "DistributedModel.is_distributed_parameter": ["param"], "DistributedModel.is_distributed_buffer": ["buf"],
    "DistributedModel.is_scaled_batch_parameter": ["param"], "DistributedModel.is_scaled_batch_buffer": ["buf"],
    **{f"DistributedModel.{n}": [] for n in (
        "local_buffers", "local_named_buffers", "local_parameters", "local_named_parameters", "local_modules",
        "local_named_modules", "local_state_dict", "state_dict", "cpu", "join", "distributed_modules",
        "default_reducer_named_parameters", "scaled_batch_reducer_named_parameters")},
    "DistributedOptimizer": ["optimizer", "static_loss_scale=1.0", "dynamic_loss_scale=False", "**dynamic_loss_args"],
    "DistributedOptimizer.state_dict": [], "DistributedOptimizer.local_state_dict": [],
    "model_creation": ["tensor_parallelism=False", "dtype=None", "**tensor_parallel_config"],
    "partition": ["index"], "delay_param_initialization": ["enabled=True"],
    "get_world_process_group": [], "get_mp_process_group": [], "get_dp_process_group": [], "is_initialized": [],
    "is_tracing": [],
    "save": ["obj", "f", "partial=True", "pickle_module", "pickle_protocol=2"],  # the page misspells pickel_module
    "load": ["f", "map_location", "pickle_module", "pickle_load_args", "partial=True"],
    "save_checkpoint": ["path", "tag", "partial=True", "model=None", "optimizer=None", "user_content=None",
                        "translate_if_full=True", "num_kept_partial_checkpoints=None"],
    "resume_from_checkpoint": ["path", "tag=None", "partial=True", "strict=True", "load_optimizer=True",
                               "load_sharded_optimizer_state=True", "translate_function=None"],
    # tensor parallelism
    "tp_register": ["dist_module", "init_hook=None", "forward_hook=None", "return_hook=None"],
    "tp_register_with_module": ["module_cls", "dist_module", "init_hook=None", "forward_hook=None",
                                "return_hook=None"],
    "tensor_parallelism": ["enabled=True", "**kwargs"], "set_tensor_parallelism": ["module", "enabled=True", "**kwargs"],
    "set_activation_checkpointing": ["module", "preserve_rng_state=True", "pack_args_as_tuple=False",
                                     "strategy='each'"],
    "patches.checkpoint.checkpoint": ["module", "*args", "preserve_rng_state=True"],
    "patches.checkpoint.checkpoint_sequential": ["sequential_module", "input", "strategy='each'",
                                                 "preserve_rng_state=True", "pack_args_as_tuple=False"],
    "nn.DistributedLinear": ["in_features", "out_features"],
    "nn.DistributedTransformerLMHead": [
        "num_layers=12", "num_attention_heads=32", "attention_head_size=32", "hidden_size=1024",
        "intermediate_size=4096", "vocab_size=30522", "num_positions=1024", "attention_dropout_prob=0.1",
        "hidden_dropout_prob=0.1", "activation='gelu'", "layernorm_epsilon=1e-5", "num_token_types=0",
        "causal_mask_size=None", "add_cross_attention=False", "add_lm_head=True", "initializer_range=0.02",
        "use_normal_initialization=False", "pre_layernorm=False", "post_layernorm=True"],
    "nn.DistributedTransformer": [
        "num_layers=12", "num_attention_heads=32", "attention_head_size=32", "hidden_size=1024",
        "intermediate_size=4096", "attention_dropout_prob=0.1", "hidden_dropout_prob=0.1", "activation='gelu'",
        "layernorm_epsilon=1e-5", "initializer_range=0.02", "use_normal_initialization=False", "causal_mask_size=None",
        "add_cross_attention=False", "pre_layernorm=False", "post_layernorm=True"],
    "nn.DistributedTransformerLayer": [
        "num_attention_heads=32", "attention_head_size=32", "hidden_size=1024", "intermediate_size=4096",
        "attention_dropout_prob=0.1", "hidden_dropout_prob=0.1", "activation='gelu'", "layernorm_epsilon=1e-5",
        "initializer_range=0.02", "use_normal_initialization=False", "causal_mask_size=None",
        "add_cross_attention=False", "pre_layernorm=False", "post_layernorm=True"],
    "nn.DistributedAttentionLayer": [
        "num_attention_heads=32", "attention_head_size=32", "hidden_size=1024", "attention_dropout_prob=0.1",
        "hidden_dropout_prob=0.1", "layernorm_epsilon=1e-5", "initializer_range=0.02",
        "use_normal_initialization=False", "cross_attention=False", "causal_mask_size=None", "pre_layernorm=False",
        "post_layernorm=True"],
    "nn.DistributedTransformerOutputLayer": [
        "hidden_size=1024", "intermediate_size=4096", "hidden_dropout_prob=0.1", "activation='gelu'",
        "layernorm_epsilon=1e-5", "initializer_range=0.02", "use_normal_initialization=False", "pre_layernorm=False",
        "post_layernorm=True", "fp32_residual_addition=False"],
    "nn.DistributedEmbedding": [
        "num_embeddings", "embedding_dim", "padding_idx=None", "max_norm=None", "norm_type=2.0",
        "scale_grad_by_freq=False", "sparse=False", "_weight=None", "initializer_range=0.02", "_skip_allgather=False",
        "_skip_scatter_and_merge=False"],
    "nn.FlashAttentionLayer": [
        "attention_dropout_prob=0.1", "attention_head_size=None", "scale_attention_scores=True",
        "scale_attn_by_layer_idx=False", "layer_idx=None", "scale=None", "triton_flash_attention=False",
        "use_alibi=False"],
    "nn.FlashAttentionLayer.forward": ["qkv", "attn_mask=None", "causal=False"],
}
# documented with their parameters as a bullet list, not as a signature: names count, order does not
BY_NAME_ONLY = {"DistributedModel"}
# the public smp.<name> forwards (*args, **kwargs) to these (smdistributed/.../torch/__init__.py _marking)
FORWARDED = {"tp_register": marking.tp_register, "tp_register_with_module": marking.tp_register_with_module,
             "tensor_parallelism": marking.tensor_parallelism, "set_tensor_parallelism": marking.set_tensor_parallelism}


def resolve(path: str):
    if path in FORWARDED:
        return FORWARDED[path]
    if path.startswith("patches.checkpoint."):
        return getattr(smp_checkpoint, path.rpartition(".")[2])
    obj = smp
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def runtime_parameters(path: str) -> list[inspect.Parameter]:
    obj = resolve(path)
    params = list(inspect.signature(obj).parameters.values())
    is_method = "." in path and path.split(".")[-2][0].isupper() and not path.startswith("nn.Distributed") \
        or path.endswith(".forward")
    return params[1:] if is_method and params and params[0].name == "self" else params


def parse(entry: str):
    """(kind, name, default or inspect.Parameter.empty) of one documented parameter."""
    if entry.startswith("**"):
        return inspect.Parameter.VAR_KEYWORD, entry[2:], inspect.Parameter.empty
    if entry.startswith("*"):
        return inspect.Parameter.VAR_POSITIONAL, entry[1:], inspect.Parameter.empty
    name, eq, default = entry.partition("=")
    return inspect.Parameter.POSITIONAL_OR_KEYWORD, name, eval(default, {"smp": smp}) if eq else inspect.Parameter.empty


@pytest.mark.parametrize("path", sorted(DOCUMENTED))
def test_the_runtime_takes_the_documented_parameters(path):
    ours = runtime_parameters(path)
    by_name = {p.name: p for p in ours}
    position, keyword_only = 0, False
    for entry in DOCUMENTED[path]:
        kind, name, default = parse(entry)
        if kind is inspect.Parameter.VAR_KEYWORD:  # documented **x: any keyword is taken
            assert any(p.kind is kind for p in ours), f"{path}: documented **{name}, ours {ours}"
            continue
        if kind is inspect.Parameter.VAR_POSITIONAL:  # what follows *args is keyword-only
            assert ours[position].kind is kind, f"{path}: documented *{name} at {position}, ours {ours}"
            position, keyword_only = position + 1, True
            continue
        assert name in by_name, f"{path}: documented parameter {name!r} missing, ours {ours}"
        p = by_name[name]
        if keyword_only:
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"{path}: {name!r} is {p.kind}, documented after *args"
        elif path not in BY_NAME_ONLY:
            assert ours.index(p) == position, f"{path}: {name!r} documented at position {position}, ours {ours}"
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{path}: {name!r} is {p.kind}, documented as positional"
        if default is not inspect.Parameter.empty:
            assert p.default == default, f"{path}: {name!r} documented default {default!r}, ours {p.default!r}"
        position += 1
    extra_required = [p for p in ours[position:] if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                      and p.name not in {parse(e)[1] for e in DOCUMENTED[path]}]
    assert not extra_required, f"{path}: parameters the docs do not have must be optional: {extra_required}"


def test_the_table_covers_every_documented_smp_callable():
    """A new documented callable must be added to the table (the surface test pins the public names)."""
    callables = {n for n in dir(smp) if not n.startswith("_") and callable(getattr(smp, n))
                 and not isinstance(getattr(smp, n), type(smp))}
    not_documented_with_parameters = {  # smp names whose docs give no parameter list to compare
        "CommGroup", "RankType", "rank", "size", "local_rank", "local_size", "dp_rank", "dp_size", "mp_rank",
        "mp_size", "pp_rank", "pp_size", "tp_rank", "tp_size", "rdp_rank", "rdp_size", "get_dp_group",
        "get_mp_group", "get_pp_group", "get_tp_group", "get_rdp_group", "get_pp_process_group",
        "get_tp_process_group", "get_rdp_process_group", "register_parameter", "set_partition", "StepOutput"}
    assert callables - set(DOCUMENTED) - not_documented_with_parameters == set()


# ---------------------------------------------------------------- each signature item, by behaviour


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))


def test_step_takes_non_split_inputs_and_input_split_axes_positionally(fresh):
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(_model())
    seen = []

    @smp.step(["mask"])  # the documented positional form (today: SMPUsageError)
    def masked(model, x, mask):
        seen.append((tuple(x.shape), tuple(mask.shape)))
        return model(x * mask)

    @smp.step(["mask"], {"x": 1})
    def by_columns(model, x, mask):
        seen.append((tuple(x.shape), tuple(mask.shape)))
        return x

    out = masked(model, torch.ones(6, 4), torch.ones(4))
    by_columns(model, torch.ones(4, 6), torch.ones(4))
    assert seen == [((3, 4), (4,)), ((3, 4), (4,)), ((4, 3), (4,)), ((4, 3), (4,))]  # mask whole, x split
    assert len(out.outputs) == 2
    with pytest.raises(smp.exceptions.SMPUsageError, match=r"non_split_inputs must be a list of argument names"):
        smp.step("mask")
    with pytest.raises(smp.exceptions.SMPUsageError, match=r"input_split_axes must map argument names"):
        smp.step(["mask"], ["x"])


def test_load_accepts_back_compat_and_then_prefers_the_pre_1_10_file_name(fresh, tmp_path):
    """transformers 4.x resumes an smp < 1.10 optimizer with smp.load(f, partial=True, back_compat=True)."""
    smp.init({})
    f = str(tmp_path / "optimizer.pt")
    smp.save({"name": "1.10+"}, f, partial=True)
    torch.save({"name": "< 1.10"}, f"{f}_{smp.mp_rank()}")  # what an smp < 1.10 job wrote
    assert smp.load(f, partial=True)["name"] == "1.10+"
    assert smp.load(f, partial=True, back_compat=True)["name"] == "< 1.10"


def test_state_cfg_answers_every_smp_key(fresh):
    from smp_adapter.config.keys import KEYS

    smp.init({"ddp": True, "skip_tracing": True, "fast_mode": True, "partitions": 1})
    cfg = smp.state.cfg
    # the keys the public AWS scripts pass and the docs list, which raised AttributeError before
    assert (cfg.contiguous, cfg.horovod, cfg.deterministic_server) == (True, False, False)
    assert (cfg.skip_tracing, cfg.fast_mode, cfg.static_mode) == (True, True, False)
    assert cfg.partitions == 1 and cfg.fp16_params is False and cfg.optimize == "memory"
    assert all(hasattr(cfg, key) for key in KEYS)
    with pytest.raises(AttributeError, match="not an smp option"):
        cfg.no_such_option


def test_explain_says_optimize_does_nothing_without_pipeline_parallelism():
    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.translate.deepspeed import to_deepspeed_config
    from smp_adapter.translate.explain import explain
    from smp_adapter.translate.megatron import to_megatron_plan

    def row(options, world):
        cfg = SMPConfig.from_dict(options)
        dims = ParallelDims.from_config(cfg, world)
        return {r.key: r for r in explain(cfg, dims, to_deepspeed_config(dims), to_megatron_plan(dims))}["optimize"]

    flat = row({"ddp": True, "optimize": "speed"}, 2)
    assert (flat.status, flat.engine_value) == ("ignored", "-") and "pipeline_parallel_degree 1" in flat.note
    piped = row({"ddp": True, "optimize": "speed", "pipeline_parallel_degree": 2}, 2)
    assert (piped.status, piped.engine_value) == ("approximated", 0.2)  # the auto-partition's memory_weight


def test_model_methods_take_the_documented_keywords(fresh):
    smp.init({})
    model = smp.DistributedModel(_model())
    weight = model.module[0].weight
    assert model.is_distributed_parameter(param=weight) is False
    assert model.is_distributed_buffer(buf=torch.zeros(1)) is False
    assert model.is_scaled_batch_buffer(buf=torch.zeros(1)) is False
    with pytest.raises(smp.exceptions.UnsupportedFeatureError, match="register_comm_hook"):
        model.register_comm_hook(state=None, callable=lambda state, bucket: bucket)


@pytest.mark.parametrize("family,getter,cls", [
    ("gpt2", "get_hf_gpt2_transformer_layer_hooks", "transformers.models.gpt2.modeling_gpt2.GPT2Block"),
    ("gpt2", "get_hf_gpt2_transformer_lm_head_hooks", "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"),
    ("bert", "get_hf_bert_transformer_hooks", "transformers.models.bert.modeling_bert.BertEncoder"),
    ("roberta", "get_hf_roberta_transformer_hooks", "transformers.models.roberta.modeling_roberta.RobertaEncoder"),
    ("gptj", "get_hf_gptj_transformer_hooks", "transformers.models.gptj.modeling_gptj.GPTJForCausalLM"),
    ("gptneo", "get_hf_gptneo_transformer_lm_head_hooks", "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoForCausalLM"),
    ("gptneox", "get_hf_gptneox_transformer_lm_head_hooks",
     "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM"),
    ("t5", "get_hf_t5_transformer_layer_hooks", "transformers.models.t5.modeling_t5.T5Block")])
def test_hf_hook_getters_register_with_the_installed_transformers(family, getter, cls):
    """smp v1's hook getters import and register (the GPT-2 custom template died at the import): the
    hooks' signatures are the Hugging Face class's own, and registering keeps the class's in-place
    split (no rebuild recorded). What a registered block computes: tests/distributed/test_tp_smp_nn.py."""
    import importlib

    module = importlib.import_module(f"smdistributed.modelparallel.torch.nn.huggingface.{family}")
    module_name, _, class_name = cls.rpartition(".")
    hf_class = getattr(importlib.import_module(module_name), class_name)
    init_hook, forward_hook, return_hook = getattr(module, getter)()
    assert inspect.signature(init_hook) == inspect.signature(hf_class.__init__).replace(
        parameters=list(inspect.signature(hf_class.__init__).parameters.values())[1:])
    dist = smp.nn.DistributedTransformerLayer if "Block" in class_name else smp.nn.DistributedTransformerLMHead
    smp.tp_register_with_module(hf_class, dist, init_hook, forward_hook, return_hook)
    assert hf_class not in marking._registry  # nothing to rebuild: hf.py splits it in place
    assert forward_hook(1, a=2) == ((1,), {"a": 2}) and return_hook("out") == "out" and init_hook(None) is None


def test_gpt2_per_block_translators_import_and_pass_the_hf_dict_through():
    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import (
        translate_hf_block_state_dict_to_smdistributed, translate_hf_state_dict_to_smdistributed_gpt2_layer,
        translate_layer_state_dict_to_hf_gpt2_block, translate_state_dict_to_hf_gpt2_layer)

    sd = {"transformer.h.0.attn.c_attn.weight": torch.ones(2, 6), "transformer.wpe.weight": torch.ones(16, 2)}
    for translate in (translate_hf_block_state_dict_to_smdistributed, translate_layer_state_dict_to_hf_gpt2_block,
                      translate_hf_state_dict_to_smdistributed_gpt2_layer, translate_state_dict_to_hf_gpt2_layer):
        out = translate(sd, 16)  # the template passes the sequence length
        assert out == sd and out is not sd
        with pytest.raises(smp.exceptions.SMPCheckpointError, match="gpt2"):
            translate({"bert.encoder.layer.0.attention.self.query.weight": torch.ones(1)})


def test_gpt2_blocks_registered_with_smps_hooks_compute_the_hf_blocks_at_tp1(fresh):
    """The GPT-2 custom template's registration at tp 1 (tp 2: tests/distributed/test_aws_style_2022.py,
    losses against the unregistered model): the wrapped model's logits equal the unregistered one's."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import get_hf_gpt2_transformer_layer_hooks

    smp.init({})
    config = GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=4, vocab_size=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    reference = GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    smp.set_tensor_parallelism(model.transformer.h, True)
    smp.tp_register_with_module(GPT2Block, smp.nn.DistributedTransformerLayer, *get_hf_gpt2_transformer_layer_hooks())
    wrapped = smp.DistributedModel(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids)["logits"], reference(input_ids=ids)["logits"])


def test_pre_1_10_scripts_reach_the_model_as_model_module_module(fresh):
    """The 2022 GPT templates: model.module.module.transformer.h (fp32), and one level more below their
    FP16_Module wrapper; nothing is registered (state-dict keys unchanged)."""

    class FP16Module(torch.nn.Module):  # the templates' wrapper: the model is its `module` child
        def __init__(self, module):
            super().__init__()
            self.module = module

    smp.init({})
    inner = _model()
    model = smp.DistributedModel(FP16Module(inner))
    assert model.module.module is inner
    below = model.module.module.module  # the model itself, seen from one level further down
    assert below[0] is inner[0] and isinstance(below, torch.nn.Sequential) and below.training is inner.training
    assert torch.equal(below(torch.ones(1, 4)), inner(torch.ones(1, 4)))
    unwrapped = model
    while hasattr(unwrapped, "module"):  # a script's or library's unwrapping loop ends
        unwrapped = unwrapped.module
    assert unwrapped[0] is inner[0]
    assert list(inner.state_dict()) == ["0.weight", "0.bias"] and len(list(inner.modules())) == 2
