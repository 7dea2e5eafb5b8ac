"""Pins the public smp surface (spec §2.1-§2.14): every documented name is importable, and the few
features smp-adapter does not carry out raise UnsupportedFeatureError naming the alternative."""

import importlib

import pytest
import torch

import smdistributed.modelparallel as smp_pkg
import smdistributed.modelparallel.torch as smp
from smp_adapter.errors import UnsupportedFeatureError

TOP_LEVEL = """init is_initialized is_tracing step StepOutput DistributedModel DistributedOptimizer
rank size local_rank local_size dp_rank dp_size mp_rank mp_size pp_rank pp_size tp_rank tp_size rdp_rank rdp_size
get_dp_group get_mp_group get_tp_group get_world_process_group get_dp_process_group get_mp_process_group
get_pp_process_group get_tp_process_group get_rdp_process_group
CommGroup RankType WORLD MP_GROUP DP_GROUP PP_GROUP TP_GROUP RDP_GROUP broadcast send recv_from allgather barrier
dp_barrier mp_barrier partition set_partition tensor_parallelism set_tensor_parallelism tp_register
tp_register_with_module model_creation delay_param_initialization set_activation_checkpointing register_parameter
save load save_checkpoint resume_from_checkpoint state nn amp optimizers""".split()

MODEL_MEMBERS = """forward backward train eval get_module module local_parameters local_named_parameters local_buffers
local_named_buffers local_modules local_named_modules state_dict local_state_dict load_state_dict
register_post_partition_hook register_post_step_hook cpu join register_comm_hook partitioned distributed_modules
is_distributed_parameter is_distributed_buffer is_scaled_batch_parameter is_scaled_batch_buffer
default_reducer_named_parameters scaled_batch_reducer_named_parameters""".split()

OPTIMIZER_MEMBERS = """step zero_grad state_dict load_state_dict local_state_dict clip_master_grads overflow
optimizer param_groups""".split()

NN = """DistributedModule DistributedLinear DistributedEmbedding DistributedTransformerLMHead DistributedTransformer
DistributedTransformerLayer DistributedAttentionLayer DistributedTransformerOutputLayer""".split()


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_name_exists(name):
    assert hasattr(smp, name), f"smp.{name} is missing"


def test_version_satisfies_v1_checks():
    major, minor, _ = (int(x) for x in smp_pkg.__version__.split("."))
    assert (major, minor) >= (1, 15)


@pytest.mark.parametrize("name", MODEL_MEMBERS)
def test_distributed_model_member(name):
    assert hasattr(smp.DistributedModel, name) or name in ("module", "partitioned")


@pytest.mark.parametrize("name", OPTIMIZER_MEMBERS)
def test_distributed_optimizer_member(name):
    assert hasattr(smp.DistributedOptimizer, name) or name == "optimizer"


@pytest.mark.parametrize("name", NN)
def test_smp_nn_names(name):
    assert getattr(smp.nn, name)


def test_sub_modules_and_spellings():
    assert smp.amp.GradScaler
    for name in ("FusedAdam", "FusedLamb", "FusedLAMB", "FusedNovoGrad"):
        assert getattr(smp.optimizers, name)
    ckpt = importlib.import_module("smdistributed.modelparallel.torch.patches.checkpoint")
    assert ckpt.checkpoint and ckpt.checkpoint_sequential
    for mod in ("smdistributed.modelparallel.torch.exceptions", "smdistributed.modelparallel.backend.exceptions"):
        assert issubclass(importlib.import_module(mod).UnsupportedFeatureError, Exception)
    for family in ("gpt2", "bert", "roberta", "gptj", "gptneo", "gptneox", "t5"):
        importlib.import_module(f"smdistributed.modelparallel.torch.nn.huggingface.{family}")
    from smdistributed.modelparallel.torch.nn.huggingface.gptj import translate_hf_gptj_state_dict_to_smdistributed_gptj  # noqa: F401,E501
    from smdistributed.modelparallel.torch.nn.huggingface.roberta import translate_state_dict_to_smdistributed  # noqa: F401


def test_unsupported_features_say_what_to_use_instead():
    with pytest.raises(UnsupportedFeatureError, match=r"FusedNovoGrad\(norm_type=1\): only the L2 norm"):
        smp.optimizers.FusedNovoGrad([torch.nn.Parameter(torch.ones(1))], norm_type=1)
    with pytest.raises(UnsupportedFeatureError, match="DistributedSampler"):
        smp.DistributedModel.join(object())
    with pytest.raises(UnsupportedFeatureError, match="remove it"):
        smp.DistributedModel.register_comm_hook(object(), None, None)
    assert smp.is_tracing() is False
