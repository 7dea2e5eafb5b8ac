"""One-time finiteness checks: a model that starts with NaN/inf weights (an initialisation path that
left a tensor unset) or whose first loss is not finite stops with one clear error, instead of
training on NaN to exit status 0 (DeepSpeed skips every step as an "overflow" and says no more).

Both checks run once per job: the weights right after ``DistributedModel`` (each rank reads what it
holds: a ZeRO-3 parameter's local shard, a tensor-parallel slice; one all-gather of a name per rank
so that every rank stops together), the loss at the first ``DistributedModel.backward``. Nothing
runs after the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.state import state

_INIT_FIX = ("an initialisation path left it unset or overflowed: build the model with its own initialisation "
             "(do not disable PreTrainedModel.init_weights / _init_weights), load finite weights, or relaunch "
             "with delayed_parameter_initialization off to see whether delayed initialisation is the cause")


def _local_data(tensor: torch.Tensor, local_data) -> torch.Tensor | None:
    """What this rank holds of ``tensor`` (``local_data``: the engine's hook, a ZeRO-3 parameter's
    shard), else the tensor; None for tensors without storage here (meta: another pipeline stage's)."""
    from smp_adapter.runtime.deferred_init import DeferredTensor

    data = local_data(tensor) if local_data is not None else tensor
    if data is None or data.is_meta or isinstance(data, DeferredTensor) or not data.is_floating_point() \
            or data.numel() == 0:  # (a delayed tensor a pipeline rank has not materialised yet)
        return None
    return data


def first_non_finite_tensor(module: nn.Module, local_data=None) -> str | None:
    """Name of the first parameter or buffer of ``module`` whose local data holds NaN or inf
    (``local_data``: the job engine's ``Engine.local_data``; None reads each tensor whole)."""
    with torch.no_grad():
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, tensor in named:
                data = _local_data(tensor, local_data)
                if data is not None and not bool(torch.isfinite(data).all()):
                    return f"{kind} {name}"
    return None


def check_initial_weights(module: nn.Module, local_data=None) -> None:
    """Raise on every rank when any rank holds a non-finite parameter or buffer."""
    import torch.distributed as dist

    found = first_non_finite_tensor(module, local_data)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
    else:
        everyone = [found]
    bad = [(rank, name) for rank, name in enumerate(everyone) if name]
    if bad:
        rank, name = bad[0]
        raise SMPUsageError(
            f"the model holds non-finite values (NaN/inf) right after smp.DistributedModel: first {name} on rank "
            f"{rank}{f' (and {len(bad) - 1} more ranks)' if len(bad) > 1 else ''}. Training it would give NaN losses; "
            + _INIT_FIX)


def check_first_loss(loss: torch.Tensor) -> None:
    """The first loss given to DistributedModel.backward (the caller runs this once)."""
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and not bool(torch.isfinite(loss.detach()).all()):
        raise SMPUsageError(
            f"the first loss is not finite ({loss.detach().float().flatten()[0].item()}) on rank {state.rank}, although "
            "the weights were finite after smp.DistributedModel: every step would be skipped as an overflow. Check the "
            "first batch (labels all ignored, e.g. -100, give NaN), the learning inputs' dtype, and under fp16 "
            "whether the forward pass overflows (use bf16)")
