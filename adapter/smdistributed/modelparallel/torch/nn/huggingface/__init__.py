"""smp.nn.huggingface.<family>: smp v1's state-dict translation functions and smp v1's hook getters."""

_FAMILIES = ("bert", "gpt2", "gptj", "gptneo", "gptneox", "llama", "roberta", "t5")


def __getattr__(name):
    # smp.nn.huggingface.gpt2.translate_state_dict_to_hf_gpt2(...) as the AWS templates write it,
    # without an import of the family module first
    if name in _FAMILIES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"smp.nn.huggingface has no family {name!r}: one of {', '.join(_FAMILIES)}")
