"""Hugging Face <-> smp state-dict translation functions (smp.nn.huggingface's translate_* functions, under smp v1's names).

Design choice: smp-adapter keeps Hugging Face models as they are and splits their layers in place,
so the "smp format" of a full (gathered) state dict *is* the Hugging Face format of the unsplit
model: same keys, same shapes (``gather_full_state_dict`` / ``DistributedModel.state_dict()`` give
it). The translation functions are therefore identity functions that *validate* their input and
return a new dict (the input is not modified):

* the dict must be a full one: a partial dict (``_smp_is_partial`` set, from ``local_state_dict()``)
  raises ``SMPCheckpointError`` saying to gather it first;
* keys may carry a ``module.`` prefix (a ``DistributedModel``'s own ``state_dict``): it is removed
  when every key has it;
* the dict must look like the family's (a marker key such as ``attn.c_attn.weight`` for GPT-2),
  so handing a BERT dict to the GPT-2 function fails loudly instead of loading garbage.

``max_seq_len`` (smp -> HF): smp v1 used it to size the causal-mask buffers of the HF model.
Current transformers build those masks on the fly (no such keys in the state dict), so ``None`` (the
default) means "leave as is"; an int is validated (positive, and not beyond the model's position
table when the dict has one) and otherwise changes nothing.

``FAMILY_FUNCTIONS`` maps each ``smp.nn.huggingface.<family>`` module name to its functions, for
the runtime to expose under ``smdistributed.modelparallel.torch.nn.huggingface``.
"""

from __future__ import annotations

from collections.abc import Mapping

from smp_adapter.errors import SMPCheckpointError

# family -> (marker key fragments: at least one must occur, position-table key fragments)
_FAMILIES = {
    "gpt2": ((".attn.c_attn.weight",), ("wpe.weight",)),
    "bert": ((".attention.self.query.weight",), ("embeddings.position_embeddings.weight",)),
    "roberta": ((".attention.self.query.weight",), ("embeddings.position_embeddings.weight",)),
    "gptj": ((".attn.q_proj.weight",), ()),
    "gptneo": ((".attn.attention.q_proj.weight",), ("wpe.weight",)),
    "gptneox": ((".attention.query_key_value.weight",), ()),
    "llama": ((".self_attn.q_proj.weight",), ()),
    "t5": ((".SelfAttention.q.weight",), ()),
}


def _validated(state_dict, family: str, max_seq_len=None) -> dict:
    if not isinstance(state_dict, Mapping):
        raise SMPCheckpointError(f"expected a state dict (a mapping of names to tensors), got {type(state_dict).__name__}")
    if state_dict.get("_smp_is_partial"):
        raise SMPCheckpointError(
            "this is a partial state dict (from local_state_dict()); translate the full one: "
            "model.state_dict() on every rdp_rank()==0 rank (gather_to_rank0=True)"
        )
    sd = {k: v for k, v in state_dict.items() if k != "_smp_is_partial"}
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    markers, positions = _FAMILIES[family]
    if not any(m in "." + k for k in sd for m in markers):
        raise SMPCheckpointError(
            f"this does not look like a {family} state dict: no key contains {' or '.join(markers)}; "
            f"use the translation function of the model's family"
        )
    if max_seq_len is not None:
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
            raise SMPCheckpointError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
        for k, v in sd.items():
            if any(k.endswith(p) for p in positions) and max_seq_len > v.shape[0]:
                raise SMPCheckpointError(
                    f"max_seq_len={max_seq_len} exceeds the model's {v.shape[0]} positions ({k})"
                )
    return sd


def _to_hf(family, name=None):
    def translate(state_dict, max_seq_len=None):
        return _validated(state_dict, family, max_seq_len)

    translate.__name__ = name or f"translate_state_dict_to_hf_{family}"
    translate.__doc__ = (f"smp (full, gathered) -> Hugging Face {family} state dict. Identity with validation: "
                         "smp-adapter's full state dict already uses the Hugging Face keys and shapes.")
    return translate


def _from_hf(family, name=None):
    def translate(state_dict, max_seq_len=None):
        # the DLC GPT-2 script passes the sequence length as a second argument; validated as for _to_hf
        return _validated(state_dict, family, max_seq_len)

    translate.__name__ = name or f"translate_hf_state_dict_to_smdistributed_{family}"
    translate.__doc__ = (f"Hugging Face {family} -> smp state dict. Identity with validation; load it with "
                         "DistributedModel.load_state_dict, which slices it for the TP ranks.")
    return translate


translate_state_dict_to_hf_gpt2 = _to_hf("gpt2")
translate_hf_state_dict_to_smdistributed_gpt2 = _from_hf("gpt2")
# the deep-learning-containers GPT-2 script imports the un-suffixed name (a later smp v1 release's)
translate_hf_state_dict_to_smdistributed = _from_hf("gpt2", "translate_hf_state_dict_to_smdistributed")
translate_state_dict_to_hf_t5 = _to_hf("t5")
translate_hf_state_dict_to_smdistributed_t5 = _from_hf("t5")
translate_state_dict_to_hf_bert = _to_hf("bert")
translate_hf_state_dict_to_smdistributed_bert = _from_hf("bert")
translate_state_dict_to_hf_roberta = _to_hf("roberta")
translate_hf_state_dict_to_smdistributed_roberta = _from_hf("roberta")
# smp v1's developer-guide RoBERTa example imports this name from the roberta module
translate_state_dict_to_smdistributed = _from_hf("roberta", "translate_state_dict_to_smdistributed")
translate_state_dict_to_hf_gptj = _to_hf("gptj")
# listed name (breaks the pattern) and the pattern name
translate_hf_gptj_state_dict_to_smdistributed_gptj = _from_hf("gptj", "translate_hf_gptj_state_dict_to_smdistributed_gptj")
translate_hf_state_dict_to_smdistributed_gptj = _from_hf("gptj")
translate_state_dict_to_hf_gptneo = _to_hf("gptneo")
translate_hf_state_dict_to_smdistributed_gptneo = _from_hf("gptneo")
# the 2022 GPT-Neo and GPT-J templates import these spellings
translate_hf_gptneo_state_dict_to_smdistributed = _from_hf("gptneo", "translate_hf_gptneo_state_dict_to_smdistributed")
translate_hf_gptj_state_dict_to_smdistributed = _from_hf("gptj", "translate_hf_gptj_state_dict_to_smdistributed")
# GPT-2 with its blocks registered by hand (get_hf_gpt2_transformer_layer_hooks, hf_hooks.py): smp v1 rebuilt
# only the blocks, so it had per-block translators; the blocks are split in place here, so the whole dict is
# Hugging Face's either way. PR 3388's custom template imports the first two names, later smp releases the others.
translate_hf_block_state_dict_to_smdistributed = _from_hf("gpt2", "translate_hf_block_state_dict_to_smdistributed")
translate_layer_state_dict_to_hf_gpt2_block = _to_hf("gpt2", "translate_layer_state_dict_to_hf_gpt2_block")
translate_hf_state_dict_to_smdistributed_gpt2_layer = _from_hf("gpt2", "translate_hf_state_dict_to_smdistributed_gpt2_layer")
translate_state_dict_to_hf_gpt2_layer = _to_hf("gpt2", "translate_state_dict_to_hf_gpt2_layer")
translate_state_dict_to_hf_gptneox = _to_hf("gptneox")
translate_hf_state_dict_to_smdistributed_gptneox = _from_hf("gptneox")  # not documented: our choice
translate_state_dict_to_hf_llama = _to_hf("llama")  # not in smp v1: same convention, for v2 migrants
translate_hf_state_dict_to_smdistributed_llama = _from_hf("llama")

FAMILY_FUNCTIONS = {
    "gpt2": {"translate_state_dict_to_hf_gpt2": translate_state_dict_to_hf_gpt2,
             "translate_hf_state_dict_to_smdistributed_gpt2": translate_hf_state_dict_to_smdistributed_gpt2,
             "translate_hf_state_dict_to_smdistributed": translate_hf_state_dict_to_smdistributed,
             "translate_hf_block_state_dict_to_smdistributed": translate_hf_block_state_dict_to_smdistributed,
             "translate_layer_state_dict_to_hf_gpt2_block": translate_layer_state_dict_to_hf_gpt2_block,
             "translate_hf_state_dict_to_smdistributed_gpt2_layer": translate_hf_state_dict_to_smdistributed_gpt2_layer,
             "translate_state_dict_to_hf_gpt2_layer": translate_state_dict_to_hf_gpt2_layer},
    "t5": {"translate_state_dict_to_hf_t5": translate_state_dict_to_hf_t5,
           "translate_hf_state_dict_to_smdistributed_t5": translate_hf_state_dict_to_smdistributed_t5},
    "bert": {"translate_state_dict_to_hf_bert": translate_state_dict_to_hf_bert,
             "translate_hf_state_dict_to_smdistributed_bert": translate_hf_state_dict_to_smdistributed_bert},
    "roberta": {"translate_state_dict_to_hf_roberta": translate_state_dict_to_hf_roberta,
                "translate_hf_state_dict_to_smdistributed_roberta": translate_hf_state_dict_to_smdistributed_roberta,
                "translate_state_dict_to_smdistributed": translate_state_dict_to_smdistributed},
    "gptj": {"translate_state_dict_to_hf_gptj": translate_state_dict_to_hf_gptj,
             "translate_hf_gptj_state_dict_to_smdistributed_gptj": translate_hf_gptj_state_dict_to_smdistributed_gptj,
             "translate_hf_state_dict_to_smdistributed_gptj": translate_hf_state_dict_to_smdistributed_gptj,
             "translate_hf_gptj_state_dict_to_smdistributed": translate_hf_gptj_state_dict_to_smdistributed},
    "gptneo": {"translate_state_dict_to_hf_gptneo": translate_state_dict_to_hf_gptneo,
               "translate_hf_state_dict_to_smdistributed_gptneo": translate_hf_state_dict_to_smdistributed_gptneo,
               "translate_hf_gptneo_state_dict_to_smdistributed": translate_hf_gptneo_state_dict_to_smdistributed},
    "gptneox": {"translate_state_dict_to_hf_gptneox": translate_state_dict_to_hf_gptneox,
                "translate_hf_state_dict_to_smdistributed_gptneox": translate_hf_state_dict_to_smdistributed_gptneox},
    "llama": {"translate_state_dict_to_hf_llama": translate_state_dict_to_hf_llama,
              "translate_hf_state_dict_to_smdistributed_llama": translate_hf_state_dict_to_smdistributed_llama},
}
