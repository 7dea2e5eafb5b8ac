"""smp v1's Hugging Face hook getters (``smp.nn.huggingface.<family>.get_hf_*_hooks``).

smp v1 shipped, per family, the three hooks ``tp_register_with_module`` takes to rebuild a Hugging
Face module as one of its own ``smp.nn`` modules (init: the config -> the smp module's arguments;
forward: the Hugging Face arguments -> the smp module's; return: its output -> what the Hugging Face
module returns), and registered them itself for the models it supported out of the box. Scripts
written against smp < 1.10 register some of them by hand, e.g. the GPT-2 custom template:
``smp.tp_register_with_module(GPT2Block, DistributedTransformerLayer, *get_hf_gpt2_transformer_layer_hooks())``.

smp-adapter splits every one of these Hugging Face modules in place instead (parallel/hf.py: the
attention and MLP of each block on Megatron-core layers, the Hugging Face forward, parameter names
and state-dict keys unchanged; see parallel/smp_layout.py for why), so a module rebuilt from these
hooks would compute the same function through a second implementation with a second weight layout.
The getters therefore return hooks that say so: registering a class with them keeps smp-adapter's
own rule for that class (``marking.tp_register_with_module`` records no rebuild), and the module is
split in place wherever it is marked for tensor parallelism. Called directly, the init hook returns
None (smp's "do not rebuild this instance"), the forward hook hands its arguments through and the
return hook its output. Their signatures are the Hugging Face class's own, so
``tp_register_with_module`` accepts them for the installed transformers release.

The per-block state-dict translators that go with the GPT-2 layer hooks are in hf_translate.py
(identity with validation: the gathered state dict already has the Hugging Face keys).
"""

from __future__ import annotations

import functools
import importlib
import inspect

# set on the hooks below: marking.tp_register_with_module keeps the class's in-place split for them
# (this module imports no torch: smp-adapter check reads HOOKED)
SPLIT_IN_PLACE = "_smp_split_in_place"

_MODELS = "transformers.models"
# (family, getter name) -> (module of the Hugging Face class, class name): the modules smp v1's getters
# were written for
HOOKED = {
    ("gpt2", "get_hf_gpt2_transformer_layer_hooks"): (f"{_MODELS}.gpt2.modeling_gpt2", "GPT2Block"),
    ("gpt2", "get_hf_gpt2_transformer_lm_head_hooks"): (f"{_MODELS}.gpt2.modeling_gpt2", "GPT2LMHeadModel"),
    ("bert", "get_hf_bert_transformer_hooks"): (f"{_MODELS}.bert.modeling_bert", "BertEncoder"),
    ("roberta", "get_hf_roberta_transformer_hooks"): (f"{_MODELS}.roberta.modeling_roberta", "RobertaEncoder"),
    ("gptj", "get_hf_gptj_transformer_hooks"): (f"{_MODELS}.gptj.modeling_gptj", "GPTJForCausalLM"),
    ("gptneo", "get_hf_gptneo_transformer_lm_head_hooks"): (f"{_MODELS}.gpt_neo.modeling_gpt_neo", "GPTNeoForCausalLM"),
    ("gptneox", "get_hf_gptneox_transformer_lm_head_hooks"): (f"{_MODELS}.gpt_neox.modeling_gpt_neox",
                                                              "GPTNeoXForCausalLM"),
    ("t5", "get_hf_t5_transformer_layer_hooks"): (f"{_MODELS}.t5.modeling_t5", "T5Block"),
}


def _without_self(method) -> inspect.Signature:
    signature = inspect.signature(method)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def split_in_place_hooks(cls: type) -> tuple:
    """(init_hook, forward_hook, return_hook) for ``cls`` that keep its in-place split."""

    def init_hook(*args, **kwargs):
        return None  # not rebuilt: parallel/hf.py splits the module in place

    def forward_hook(*args, **kwargs):
        return args, kwargs

    def return_hook(output):
        return output

    init_hook.__signature__ = _without_self(cls.__init__)
    forward_hook.__signature__ = _without_self(cls.forward)
    for hook in (init_hook, forward_hook, return_hook):
        hook.__qualname__ = f"{cls.__name__}.{hook.__name__}"
        setattr(hook, SPLIT_IN_PLACE, cls)
    return init_hook, forward_hook, return_hook


def _getter(family: str, name: str):
    module_name, class_name = HOOKED[(family, name)]

    @functools.cache
    def get_hooks() -> tuple:
        return split_in_place_hooks(getattr(importlib.import_module(module_name), class_name))

    get_hooks.__name__ = get_hooks.__qualname__ = name
    get_hooks.__doc__ = (f"smp v1's hooks for registering {class_name} with smp.tp_register_with_module; here they "
                         f"keep smp-adapter's in-place split of {class_name} (smp_adapter/parallel/hf_hooks.py)")
    return get_hooks


FAMILY_HOOKS: dict[str, dict] = {}
for (_family, _name) in HOOKED:
    FAMILY_HOOKS.setdefault(_family, {})[_name] = _getter(_family, _name)
