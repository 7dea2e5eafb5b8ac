"""smp v1's kernel switches carried out in a training process (what each becomes, in words:
translate/kernels.py, the one home of that wording).

* Attention: ``install_attention_recorder`` wraps ``torch.nn.functional.scaled_dot_product_attention``
  (at smp.init, over whatever is there: runtime/cpu_attention.py's wrapper on some CPUs) so the first
  call of each kind (device, dtype, mask/causal, dropout) runs under a dispatch mode that sees which aten
  kernel SDPA chose: the backend that *ran*, not the one asked for. Rank 0 says it once per kind
  (stderr); ``attention_backends()`` returns the record. Later calls pay one dictionary lookup. Compiled
  and exported code (dynamo tracing, pipeline stages) is not recorded: the kernel is chosen inside the
  graph there.
* ``model_creation(flash_attention=True)`` (or ``fused_softmax=True``: torch fuses the softmax only
  inside SDPA): Hugging Face models built with eager attention are switched to ``sdpa`` at
  ``smp.DistributedModel`` (``use_sdpa_attention``).
* Optimizers: compat/fused_optimizers.py ``prefer_fused`` (with the optimizers, below this floor).
* ``SMP_ADAPTER_COMPILE=blocks``: ``compile_blocks`` compiles each repeated block's forward on its own
  (torch.compile, as torchtitan): the module tree, its parameter names and the hooks engines register
  on the block (FSDP2's gathers) stay outside the graph; one graph serves every block of a class.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from smp_adapter import on_shutdown
from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.translate.kernels import CompileSetting, compile_refusal

# aten kernel SDPA dispatches to -> the backend's name; none of these seen: the math composite ran
SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
}
MATH = "math"

_seen: dict[tuple, str] = {}  # (device type, dtype, mask kind, dropout) -> backend that ran
_requested: set[str] = set()  # kernel keywords model_creation was asked for (flash_attention, fused_softmax)
_installed = False


@on_shutdown
def reset() -> None:
    """Run by smp.shutdown: the record and the requests belong to one job."""
    _seen.clear()
    _requested.clear()


def attention_backends() -> dict[tuple, str]:
    """{(device type, dtype, "mask" | "causal" | "none", dropout > 0): backend} for every kind of
    attention call this process ran since smp.init."""
    return dict(_seen)


def backend_of(op_names) -> str:
    for name in op_names:  # "aten._scaled_dot_product_flash_attention.default" or "aten::..."
        backend = SDPA_KERNELS.get(name.removeprefix("aten::").removeprefix("aten.").split(".")[0])
        if backend:
            return backend
    return MATH


def op_names_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__ if hasattr(func, "__name__") else str(func))
            return func(*args, **(kwargs or {}))

    return OpNames()


def _recordable(query) -> bool:
    # plain tensors only: fake/meta tensors (tracing) and tensor subclasses keep their own dispatch
    return (type(query) in (torch.Tensor, nn.Parameter) and not query.is_meta
            and not torch.compiler.is_compiling())


def install_attention_recorder(rank: int) -> bool:
    """Wrap torch's SDPA functional once per process (later calls only update the rank that speaks)."""
    global _installed, _speaker
    _speaker = rank
    if _installed:
        return False
    inner = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if _recordable(query):
            kind = (query.device.type, str(query.dtype).removeprefix("torch."),
                    "mask" if attn_mask is not None else "causal" if is_causal else "none", dropout_p > 0)
            if kind not in _seen:
                mode = op_names_mode()
                with mode:
                    out = inner(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
                _seen[kind] = backend_of(mode.names)
                if _speaker == 0:
                    print(f"smp-adapter: attention ({kind[0]} {kind[1]}, {kind[2]}{', dropout' if kind[3] else ''}) "
                          f"ran on SDPA's {_seen[kind]} kernel", file=sys.stderr, flush=True)
                return out
        return inner(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    scaled_dot_product_attention.__doc__ = inner.__doc__
    scaled_dot_product_attention.__wrapped__ = inner
    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    _installed = True
    return True


_speaker = 0


# -- model_creation keywords ------------------------------------------------------------------------
def request(config: dict) -> None:
    """model_creation's kernel keywords asked for (a true value) that act on the model, applied at
    smp.DistributedModel: flash_attention, and fused_softmax, whose fused softmax torch has only
    inside SDPA's kernels; both switch eager attention to SDPA."""
    _requested.update(k for k in ("flash_attention", "fused_softmax") if config.get(k))


def use_sdpa_attention(module: nn.Module) -> list[str]:
    """Hugging Face models inside ``module`` whose attention is 'eager' and whose class has an SDPA
    path switched to 'sdpa'; returns the class names switched. Models without one keep theirs."""
    switched = []
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) != "eager" or not getattr(m, "_supports_sdpa", False):
            continue
        if hasattr(m, "set_attn_implementation"):
            m.set_attn_implementation("sdpa")
            switched.append(type(m).__name__)
        elif _swap_attention_classes(m, config):
            switched.append(type(m).__name__)
    return switched


def _swap_attention_classes(model: nn.Module, config) -> bool:
    """transformers 4.x before ``set_attn_implementation`` (4.38 among them): the attention class is chosen
    when a layer is built, from the modeling file's ``<FAMILY>_ATTENTION_CLASSES`` table ({"eager": ...,
    "sdpa": ...}, the SDPA class a subclass of the eager one with the same parameters); the masks follow
    ``config._attn_implementation`` (or a ``_use_sdpa`` flag set from it) at every forward. So: each eager
    attention module takes its table's SDPA class, and the config and flags say 'sdpa'. False (nothing
    changed) where the modeling file has no such table."""
    swaps = []
    for sub in model.modules():
        tables = [v for k, v in vars(sys.modules.get(type(sub).__module__, object)).items()
                  if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict)]
        for table in tables:
            eager, sdpa = table.get("eager"), table.get("sdpa")
            if type(sub) is eager and sdpa is not None and issubclass(sdpa, eager):
                swaps.append((sub, sdpa))
    if not swaps:
        return False
    for sub, sdpa in swaps:
        sub.__class__ = sdpa
    config._attn_implementation = "sdpa"
    for sub in model.modules():
        if hasattr(sub, "_use_sdpa"):
            sub._use_sdpa = True
    return True


# -- compile per block -------------------------------------------------------------------------------
def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """Every element of an ``nn.ModuleList`` that holds parameters (a transformer's layers: Hugging
    Face's ``h`` / ``layers`` / ``layer``, smp's ``seq_layers``), innermost lists left to their outer
    element. MiCS shards these as its units (runtime/engines/mics/mesh.py)."""
    blocks: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                for element in child:
                    if id(element) not in claimed and any(True for _ in element.parameters()):
                        blocks.append(element)
                        claimed.add(id(element))
                continue
            visit(child)

    visit(module)
    return blocks


def compile_blocks(module: nn.Module, setting: CompileSetting) -> int:
    """Compile each repeated block's forward (``setting.backend``); returns how many. Only the forward
    is replaced: ``module.compile()`` would put the hooks of the block (FSDP2's gathers) inside the
    graph; a wrapper module would rename every parameter (``_orig_mod.``)."""
    blocks = repeated_blocks(module)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=setting.backend)
    return len(blocks)


def apply_at_wrap(module: nn.Module, dims, setting: CompileSetting, rank: int) -> None:
    """What smp.DistributedModel does for the kernel switches, after the tensor-parallel split and
    before the engine (MiCS shards the compiled blocks, as torchtitan compiles before fully_shard)."""
    if _requested & {"flash_attention", "fused_softmax"}:
        use_sdpa_attention(module)
        kept = sorted({type(m).__name__ for m in module.modules()
                       if getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"
                       and hasattr(m, "_supports_sdpa")})
        if kept and rank == 0:  # said, not silent: explain and check promise SDPA for these keywords
            print(f"smp-adapter: model_creation({'/'.join(sorted(_requested))}=True): this transformers release has "
                  f"no SDPA attention for {', '.join(kept)}: eager attention kept", file=sys.stderr, flush=True)
    if setting.on:
        refusal = compile_refusal(dims)
        if refusal:
            raise UnsupportedFeatureError(refusal)
        n = compile_blocks(module, setting)
        if rank == 0:
            print(f"smp-adapter: SMP_ADAPTER_COMPILE={setting}: {n} block(s) compiled "
                  f"({setting.backend}, at their first call)" if n else
                  f"smp-adapter: SMP_ADAPTER_COMPILE={setting}: no repeated block (nn.ModuleList) found, nothing "
                  "compiled", file=sys.stderr, flush=True)
