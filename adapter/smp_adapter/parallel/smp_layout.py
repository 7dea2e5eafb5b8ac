"""smp v1's distributed-transformer layout over Hugging Face models (issue 12, item 2).

smp v1 replaced the block list of a Hugging Face model created inside
``smp.model_creation(tensor_parallelism=True)`` / ``smp.tensor_parallelism()`` by its own
``DistributedTransformer``, and the public AWS scripts walk that layout:
``model.get_module().transformer.seq_layers`` (an ``nn.Sequential``), each layer's ``.attention``
and ``.output``, for ``smp.set_partition`` and ``smp.set_activation_checkpointing``.

Design choice: **names over the Hugging Face modules**, not new modules. smp-adapter keeps the
Hugging Face blocks (split in place on Megatron-core layers by ``parallel/hf.py``), so

* the layout is added as class-level *properties*: each marked model's and block's class is swapped
  for a subclass with the same name that adds ``seq_layers`` / ``attention`` / ``output`` (and
  ``transformer`` where the family calls its body something else). Nothing is registered twice, so
  ``state_dict()`` keys, parameter counts, ZeRO-3 hooks, torch.export (pipeline stages) and
  ``deepcopy`` see exactly the Hugging Face model;
* ``seq_layers`` is a fresh ``nn.Sequential`` view over the same block objects on each access:
  marks (``set_partition``) and checkpointing (``set_activation_checkpointing``) applied through it
  land on the blocks the model runs;
* the smp-format state dict *is* the Hugging Face one, so the clients' translate functions
  (``smp.nn.huggingface.<family>``) validate and pass keys through unchanged.

Why not real smp modules on Megatron-core: they would need a second weight layout, a key mapping
per family in both directions, and would lose the Hugging Face forward (masks, rotary embeddings,
caches) that the rest of smp-adapter is tested against. The price: module *types* and ``repr``
differ from smp v1's (``GPT2Block`` rather than ``DistributedTransformerLayer``), which no public
script depends on.
"""

from __future__ import annotations

from torch import nn

# block class name -> (attribute holding smp's ``attention``, attribute holding smp's ``output``)
_BLOCK_PARTS = {
    "GPT2Block": ("attn", "mlp"),
    "GPTJBlock": ("attn", "mlp"),
    "GPTNeoBlock": ("attn", "mlp"),
    "GPTNeoXLayer": ("attention", "mlp"),
    "LlamaDecoderLayer": ("self_attn", "mlp"),
    "MistralDecoderLayer": ("self_attn", "mlp"),
    "Qwen2DecoderLayer": ("self_attn", "mlp"),
    "FalconDecoderLayer": ("self_attention", "mlp"),
    "BloomBlock": ("self_attention", "mlp"),
    "BertLayer": ("attention", "output"),
    "RobertaLayer": ("attention", "output"),
    "ViTLayer": ("attention", "output"),
    "T5Block": ("layer.0", "layer.-1"),
}
# where a family's body keeps its block list, in the order they are tried
_BLOCK_LISTS = ("h", "layers", "blocks", "block", "encoder.layer", "encoder.layers")
# attributes of a *ForCausalLM / *LMHeadModel that hold the body, for ``.transformer``
_BODIES = ("transformer", "gpt_neox", "model", "bert", "roberta", "vit")

_subclasses: dict[tuple[type, tuple[str, ...]], type] = {}


def _get(obj, path: str):
    for part in path.split("."):
        obj = obj[int(part)] if part.lstrip("-").isdigit() else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _block_parts(block: nn.Module):
    """(attention, output) attribute paths of a block, found by its Hugging Face class's name anywhere in its
    class's ancestry: FSDP2's ``fully_shard`` (the MiCS engine) swaps a block's class for a subclass named
    ``FSDP<name>``, and this module's own layout subclass sits between the two."""
    for cls in type(block).__mro__:
        if cls.__name__ in _BLOCK_PARTS:
            return _BLOCK_PARTS[cls.__name__]
    return None


def block_list(body: nn.Module):
    """The ModuleList of transformer blocks of a Hugging Face body (GPT2Model, GPTNeoXModel, ...)."""
    for path in _BLOCK_LISTS:
        found = _get(body, path)
        if isinstance(found, nn.ModuleList) and len(found) and _block_parts(found[0]) is not None:
            return found
    return None


def _with_properties(obj: nn.Module, props: dict) -> None:
    """Swap ``obj``'s class for a same-named subclass carrying ``props`` (name -> getter)."""
    props = {n: g for n, g in props.items() if n not in type(obj).__dict__ and n not in vars(obj)
             and n not in dict(obj.named_children())}
    if not props:
        return
    cls = type(obj)
    key = (cls, tuple(sorted(props)))
    sub = _subclasses.get(key)
    if sub is None:
        sub = type(cls.__name__, (cls,), {n: property(g) for n, g in props.items()})
        sub.__qualname__, sub.__module__ = cls.__qualname__, cls.__module__
        sub._smp_layout_of = cls
        _subclasses[key] = sub
    obj.__class__ = sub


def _part_getter(path: str):
    return lambda self: _get(self, path)


def add_smp_layout(model: nn.Module) -> bool:
    """Give a Hugging Face model smp's distributed-transformer names; True if it has blocks."""
    body = model if block_list(model) is not None else None
    if body is None:
        for name in _BODIES:
            candidate = getattr(model, name, None)
            if isinstance(candidate, nn.Module) and block_list(candidate) is not None:
                body = candidate
                if name != "transformer":
                    _with_properties(model, {"transformer": _part_getter(name)})
                break
    if body is None:
        return False
    blocks = block_list(body)
    for block in blocks:
        attention, output = _block_parts(block)
        _with_properties(block, {"attention": _part_getter(attention), "output": _part_getter(output)})
    _with_properties(body, {"seq_layers": lambda self: nn.Sequential(*block_list(self))})
    return True


class _ModelSeenFromBelow:
    """What the wrapped model's ``.module`` answers (see add_pre_1_10_module_alias): the model itself,
    seen through a view that forwards every attribute and call to it except ``module`` (so a loop
    unwrapping ``.module`` ends here instead of running forever); ``isinstance`` sees the model's class."""

    __slots__ = ("_model",)

    def __init__(self, model: nn.Module):
        object.__setattr__(self, "_model", model)

    def __getattr__(self, name):
        if name == "module":
            raise AttributeError(f"{type(self._model).__name__}.module.module: the model has no deeper module")
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        setattr(self._model, name, value)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def __getitem__(self, key):  # containers (nn.Sequential, ModuleList) index and iterate as themselves
        return self._model[key]

    def __iter__(self):
        return iter(self._model)

    def __len__(self):
        return len(self._model)

    @property
    def __class__(self):
        return type(self._model)

    def __repr__(self):
        return repr(self._model)


def add_pre_1_10_module_alias(model: nn.Module) -> None:
    """smp < 1.10 kept the wrapped model one level further down: scripts of that time reach it as
    ``model.module.module`` (the 2022 GPT templates: ``model.module.module.transformer.h``, and with
    their FP16_Module wrapper one level more), where smp 1.10+ and smp-adapter have ``model.module`` /
    ``model.get_module()``. The innermost model (below wrappers that hold it as their ``module`` child)
    answers ``.module`` with itself, seen through ``_ModelSeenFromBelow``, when it has no attribute of
    that name: a class-level property, as above (nothing registered, state dicts unchanged)."""
    inner = model
    while isinstance(inner._modules.get("module"), nn.Module):
        inner = inner._modules["module"]
    if not hasattr(inner, "module"):
        _with_properties(inner, {"module": _ModelSeenFromBelow})
