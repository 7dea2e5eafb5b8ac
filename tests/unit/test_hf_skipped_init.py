"""The GPT templates' start-up shortcut ``PreTrainedModel.init_weights = lambda x: None`` (they count on smp v1's
distributed modules drawing the weights): a model created for tensor parallelism still gets transformers' own
initialisation, draw for draw (compat/hf_skipped_init.py)."""

import importlib
import sys

import pytest
import torch

import smdistributed.modelparallel.torch as smp  # noqa: F401  (installs the hook, as a script's import does)
from smp_adapter.compat import hf_skipped_init
from smp_adapter.parallel.marking import tensor_parallelism

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.modeling_utils import PreTrainedModel  # noqa: E402

CONFIG = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16)


@pytest.fixture
def template_shortcut():
    original = PreTrainedModel.__dict__["init_weights"]
    PreTrainedModel.init_weights = lambda x: None
    yield
    PreTrainedModel.init_weights = original


def _created(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def test_a_model_created_for_tensor_parallelism_gets_transformers_init_draw_for_draw():
    reference = _created()
    shortcut = PreTrainedModel.init_weights = lambda x: None
    try:
        skipped = _created()
        with tensor_parallelism(True):
            model = _created()
        assert PreTrainedModel.__dict__["init_weights"] is shortcut  # the script's function is back afterwards
    finally:
        PreTrainedModel.init_weights = hf_skipped_init._original_init_weights
    assert skipped.lm_head.weight is not skipped.transformer.wte.weight  # what the shortcut alone leaves
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_hook_remembers_init_weights_when_the_module_is_imported_after_smp(monkeypatch, tmp_path):
    # a stand-in module (re-importing transformers' own would leave two PreTrainedModel classes behind)
    name = "transformers_stand_in_modeling_utils"
    (tmp_path / f"{name}.py").write_text("class PreTrainedModel:\n    def init_weights(self):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hf_skipped_init, "MODELING_UTILS", name)
    monkeypatch.setattr(hf_skipped_init, "_original_init_weights", None)
    try:
        hf_skipped_init.install()
        assert any(isinstance(f, hf_skipped_init._RememberOnImport) for f in sys.meta_path)
        module = importlib.import_module(name)
        assert hf_skipped_init._original_init_weights is module.PreTrainedModel.__dict__["init_weights"]
        assert not any(isinstance(f, hf_skipped_init._RememberOnImport) for f in sys.meta_path)
    finally:
        hf_skipped_init.uninstall()
        sys.modules.pop(name, None)


def test_replaced_before_smp_was_imported_distributed_model_draws_the_family_init(monkeypatch, template_shortcut):
    monkeypatch.setattr(hf_skipped_init, "_original_init_weights", None)  # nothing was remembered
    with tensor_parallelism(True):
        model = _created()
    assert hf_skipped_init.skipped_init(model)
    assert hf_skipped_init.initialize_skipped_weights(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2's _init_weights: N(0, 0.02) embeddings (the constructors alone leave N(0, 1))
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.005


def test_distributed_model_redoes_nothing_where_the_creation_ran_transformers_init(template_shortcut):
    with tensor_parallelism(True):
        model = _created()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert hf_skipped_init.skipped_init(model)  # the class still resolves to the script's function ...
    assert not hf_skipped_init.initialize_skipped_weights(model)  # ... but its creation ran transformers' own
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
