"""smp's call-site activation checkpointing (smp.set_activation_checkpointing, docs/runtime.md), on torch.utils.checkpoint."""

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.memory import sequential_groups


def checkpoint(module, *args, preserve_rng_state=True, **kwargs):
    if not isinstance(module, nn.Module):
        raise SMPUsageError("smp checkpoint() takes a module instance (not a function), as in smp v1; "
                            "for functions use torch.utils.checkpoint.checkpoint")
    if not torch.is_grad_enabled():
        return module(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state, **kwargs)


def checkpoint_sequential(sequential_module, input, strategy="each", preserve_rng_state=True,
                          pack_args_as_tuple=False):
    if not isinstance(sequential_module, nn.Sequential):
        raise SMPUsageError("checkpoint_sequential takes an nn.Sequential")

    def run(group):
        def segment(x):
            for layer in group:
                x = layer(*x) if pack_args_as_tuple and isinstance(x, tuple) else layer(x)
            return x
        return segment

    out = input
    for group in sequential_groups(sequential_module, strategy):
        if torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(run(group), out, use_reentrant=False,
                                                    preserve_rng_state=preserve_rng_state)
        else:
            out = run(group)(out)
    return out
