"""Running a module's forward under torch.utils.checkpoint (non-reentrant): the mechanism behind
``smp.set_activation_checkpointing`` (runtime/memory.py), shared with the pipeline engine, which
applies it again to the traced copy of each marked module in a stage (torch.export inlines it)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from smp_adapter.runtime.state import state


def checkpoint_forward(module: nn.Module, preserve_rng_state: bool, followers: list[nn.Module]) -> None:
    if getattr(module, "_smp_checkpointed", False):
        return
    original = module.forward
    # transformers 4.x blocks return a tuple (hidden_states, present, ...) whose first element the
    # model's loop feeds to the next block: length of the leader's last output, 0 for a tensor
    out_len = [0]

    def follower_identity(x, *a, **k):
        return (x,) + (None,) * (out_len[0] - 1) if out_len[0] else x

    for f in followers:  # run inside the leader's segment; their own forward is then the identity
        f._smp_original_forward = f.forward
        f.forward = follower_identity
        f._smp_checkpointed = True

    def segment(*args, **kwargs):
        out = original(*args, **kwargs)
        out_len[0] = len(out) if isinstance(out, tuple) else 0
        # a follower gets the previous output in place of the first argument and the leader's other
        # arguments: Hugging Face blocks all take (hidden_states, mask, ..., **kwargs) from one loop
        for f in followers:
            out = f._smp_original_forward(out[0] if isinstance(out, tuple) else out, *args[1:], **kwargs)
        return out

    def checkpointed_forward(*args, **kwargs):
        if not (torch.is_grad_enabled() and module.training):
            return segment(*args, **kwargs)
        offload = state.initialized and state.cfg.offload_activations and torch.cuda.is_available()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
        with ctx:
            return torch.utils.checkpoint.checkpoint(segment, *args, use_reentrant=False,
                                                     preserve_rng_state=preserve_rng_state, **kwargs)

    module.forward = checkpointed_forward
    module._smp_checkpointed = True
    module._smp_preserve_rng = preserve_rng_state  # a pipeline stage's traced copy is wrapped alike
