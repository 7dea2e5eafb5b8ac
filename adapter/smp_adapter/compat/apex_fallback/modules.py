"""The rest of apex's Python names the public smp v1 scripts import: ``apex.normalization``'s
``FusedLayerNorm``, ``apex.amp``, ``apex.parallel``'s ``DistributedDataParallel`` and
``flat_dist_call``.

``apex.amp`` (mixed precision by patching torch and wrapping the optimizer) is not carried out:
smp's own ``fp16`` / ``bf16`` options do that job in an smp job (DeepSpeed's loss scaling at pp = 1,
smp-adapter's fp32 masters at pp > 1), and ``smp.amp.GradScaler`` / ``torch.autocast`` do it in the
script. As in apex: ``initialize(..., enabled=False)`` returns the models and optimizers unchanged
and afterwards ``scale_loss`` yields the loss unchanged; ``master_params(optimizer)`` iterates the
optimizer's parameters. ``initialize(enabled=True)`` raises ``UnsupportedFeatureError`` naming
those replacements, and so does ``scale_loss`` before any ``initialize`` (apex raises there too).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from torch import nn

from smp_adapter.compat.apex_fallback import AMP_REPLACEMENT, DDP_REPLACEMENT
from smp_adapter.compat.apex_fallback.multi_tensor import flatten, unflatten
from smp_adapter.errors import UnsupportedFeatureError


class FusedLayerNorm(nn.LayerNorm):
    """``apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``:
    layer normalisation with torch's kernel (fused on GPUs)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)


# ---------------------------------------------------------------- apex.amp


class AmpState:
    """apex's ``_amp_state``: ``opt_properties`` exists once ``initialize`` ran."""

    def __init__(self):
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


class _Properties:
    def __init__(self, enabled: bool):
        self.enabled = enabled


_amp_state = AmpState()


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
               cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None, max_loss_scale=2.0 ** 24):
    if enabled:
        raise UnsupportedFeatureError(
            f"apex.amp.initialize(opt_level={opt_level!r}) is not carried out by smp-adapter's apex fallback "
            f"(NVIDIA apex is not installed): {AMP_REPLACEMENT}; or install NVIDIA apex")
    _amp_state.opt_properties = _Properties(enabled=False)
    _amp_state.verbosity = verbosity
    return models if optimizers is None else (models, optimizers)


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    if not hasattr(_amp_state, "opt_properties"):
        raise UnsupportedFeatureError(
            "apex.amp.scale_loss before apex.amp.initialize: smp-adapter's apex fallback does not scale losses "
            f"(NVIDIA apex is not installed): {AMP_REPLACEMENT}")
    yield loss  # amp is off (initialize(enabled=False)): apex yields the loss unchanged too


def master_params(optimizer):
    """The parameters ``optimizer`` updates, group by group (apex's definition)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None):
    raise UnsupportedFeatureError(f"apex.amp.state_dict: amp is not carried out here: {AMP_REPLACEMENT}")


def load_state_dict(state_dict):
    raise UnsupportedFeatureError(f"apex.amp.load_state_dict: amp is not carried out here: {AMP_REPLACEMENT}")


# ---------------------------------------------------------------- apex.parallel


class DistributedDataParallel(nn.Module):
    """apex's DDP wrapper: not carried out (data parallelism belongs to smp here)."""

    def __init__(self, module, *args, **kwargs):
        raise UnsupportedFeatureError(
            f"apex.parallel.DistributedDataParallel is not carried out by smp-adapter's apex fallback: {DDP_REPLACEMENT}")


def flat_dist_call(tensors, call, extra_args=None):
    """apex's ``flat_dist_call``: per tensor type, flatten the tensors, ``call(flat, *extra_args)``
    (``dist.all_reduce`` results are then divided by the world size), copy the result back."""
    buckets: OrderedDict = OrderedDict()
    for t in tensors:
        buckets.setdefault(t.type(), []).append(t)
    for bucket in buckets.values():
        coalesced = flatten(bucket)
        call(coalesced, *extra_args) if extra_args is not None else call(coalesced)
        if call is torch.distributed.all_reduce:
            coalesced /= torch.distributed.get_world_size()
        for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
            buf.copy_(synced)
