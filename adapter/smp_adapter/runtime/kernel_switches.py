"""smp v1's kernel switches carried out on the model, at smp.DistributedModel (what each becomes, in
words: translate/kernels.py, the one home of that wording).

* ``model_creation(flash_attention=True)`` (or ``fused_softmax=True``: torch fuses the softmax only
  inside SDPA): Hugging Face models built with eager attention are switched to ``sdpa``
  (compat/hf_attention.py ``use_sdpa_attention``). Which SDPA backend then runs is recorded by
  runtime/attention.py, the one wrapper of torch's SDPA.
* Optimizers: compat/fused_optimizers.py ``prefer_fused`` (with the optimizers, below this floor).
* ``SMP_ADAPTER_COMPILE=blocks``: ``compile_blocks`` compiles each repeated block's forward on its own
  (torch.compile, as torchtitan): the module tree, its parameter names and the hooks engines register
  on the block (FSDP2's gathers) stay outside the graph; one graph serves every block of a class.
  ``repeated_blocks`` is also what MiCS shards as its units (runtime/engines/mics/units.py).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from smp_adapter import on_shutdown
from smp_adapter.compat.hf_attention import eager_attention_kept, use_sdpa_attention
from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.translate.kernels import CompileSetting, compile_refusal

_requested: set[str] = set()  # kernel keywords model_creation was asked for (flash_attention, fused_softmax)


@on_shutdown
def reset() -> None:
    """Run by smp.shutdown: the requests belong to one job."""
    _requested.clear()


def request(config: dict) -> None:
    """model_creation's kernel keywords asked for (a true value) that act on the model, applied at
    smp.DistributedModel: flash_attention, and fused_softmax, whose fused softmax torch has only
    inside SDPA's kernels; both switch eager attention to SDPA."""
    _requested.update(k for k in ("flash_attention", "fused_softmax") if config.get(k))


# -- compile per block -------------------------------------------------------------------------------
def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """Every element of an ``nn.ModuleList`` that holds parameters (a transformer's layers: Hugging
    Face's ``h`` / ``layers`` / ``layer``, smp's ``seq_layers``), innermost lists left to their outer
    element. MiCS shards these as its units (runtime/engines/mics/units.py)."""
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
        kept = eager_attention_kept(module)
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
