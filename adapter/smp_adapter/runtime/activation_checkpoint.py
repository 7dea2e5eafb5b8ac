"""Activation checkpointing, the mechanism behind ``smp.set_activation_checkpointing``
(runtime/memory.py), shared by both engines.

* ``checkpoint_forward``: a module's forward (a segment: the module and the followers it runs)
  is re-run during backward (torch.utils.checkpoint, non-reentrant, which also works under ZeRO-3).
  With ``offload_activations`` on a GPU the tensors a segment saves go to CPU memory.
* Pipeline stages (pp > 1) are traced with torch.export, which would inline the checkpoint: the
  traced stage keeps every activation. Worse, the checkpoint's saved-tensor hook turns grad mode
  off and on around each saved tensor, export records those switches as grad-mode regions, and a
  pipeline split marker inside such a region is not seen (the split yields fewer stages). So the
  stage tracer runs under ``tracing_plain()`` (every module runs its own plain forward, the
  members of an nn.Sequential group each on its own), and the pipeline engine then
  wraps each checkpointed module's traced submodule in the stage (the same qualified name) with the
  same checkpoint (pipeline/surgery.py ``checkpoint_marked``): a group's members one by one there.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from smp_adapter.runtime.state import state

_plain = [False]  # True while a pipeline stage is being traced


def run_checkpointed(fn, preserve_rng_state: bool, *args, **kwargs):
    offload = state.initialized and state.cfg.offload_activations and torch.cuda.is_available()
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
    with ctx:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 preserve_rng_state=preserve_rng_state, **kwargs)


def checkpoint_forward(module: nn.Module, preserve_rng_state: bool, followers: list[nn.Module]) -> None:
    """Checkpoint ``module``'s forward; ``followers`` (the next modules of an nn.Sequential group)
    run inside its segment and their own forward becomes the identity."""
    if getattr(module, "_smp_checkpointed", False):
        return
    original = module.forward
    # transformers 4.x blocks return a tuple (hidden_states, present, ...) whose first element the
    # model's loop feeds to the next block: length of the leader's last output, 0 for a tensor
    out_len = [0]

    def follower_forward(f):
        def forward(x, *a, **k):
            if _plain[0]:  # traced on its own (a module run inside another would not outline)
                return f._smp_original_forward(x, *a, **k)
            return (x,) + (None,) * (out_len[0] - 1) if out_len[0] else x
        return forward

    for f in followers:  # run inside the leader's segment; their own forward is then the identity
        f._smp_original_forward = f.forward
        f.forward = follower_forward(f)
        f._smp_checkpointed = True
        f._smp_preserve_rng = preserve_rng_state  # a traced stage checkpoints each member on its own

    def segment(*args, **kwargs):
        out = original(*args, **kwargs)
        out_len[0] = len(out) if isinstance(out, tuple) else 0
        # a follower gets the previous output in place of the first argument and the leader's other
        # arguments: Hugging Face blocks all take (hidden_states, mask, ..., **kwargs) from one loop
        for f in followers:
            out = f._smp_original_forward(out[0] if isinstance(out, tuple) else out, *args[1:], **kwargs)
        return out

    def checkpointed_forward(*args, **kwargs):
        if _plain[0]:
            return original(*args, **kwargs)
        if not (torch.is_grad_enabled() and module.training):
            return segment(*args, **kwargs)
        return run_checkpointed(segment, preserve_rng_state, *args, **kwargs)

    module.forward = checkpointed_forward
    module._smp_checkpointed = True
    module._smp_preserve_rng = preserve_rng_state  # a pipeline stage's traced copy is wrapped alike


@contextlib.contextmanager
def tracing_plain():
    """Segments run their plain forward (no checkpoint) while a pipeline stage is traced."""
    previous, _plain[0] = _plain[0], True
    try:
        yield
    finally:
        _plain[0] = previous
