"""smp.optimizers: the apex fused optimizers smp v1 shipped (spec §2.12, §5.8).

FusedAdam is torch's AdamW (its fused kernel on CUDA). FusedLAMB / FusedLamb / FusedNovoGrad follow
apex's definitions in plain PyTorch on every device: smp_adapter/runtime/fused_optimizers.py."""

import torch

from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.runtime.fused_optimizers import FusedLAMB, FusedNovoGrad

FusedLamb = FusedLAMB

__all__ = ["FusedAdam", "FusedLAMB", "FusedLamb", "FusedNovoGrad"]


class FusedAdam(torch.optim.AdamW):
    """apex FusedAdam semantics (decoupled weight decay, adam_w_mode=True) on torch's AdamW;
    adam_w_mode=False (L2 regularisation) is torch's Adam. torch's fused kernel is used on CUDA."""

    def __new__(cls, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                weight_decay=0.0, amsgrad=False, **kwargs):
        if not bias_correction:
            raise UnsupportedFeatureError("FusedAdam(bias_correction=False) is not supported: torch's Adam always "
                                          "corrects the moment bias; remove the argument")
        if adam_w_mode:
            return super().__new__(cls)
        fused = kwargs.pop("fused", torch.cuda.is_available())
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                fused=fused)

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, **kwargs):
        fused = kwargs.pop("fused", torch.cuda.is_available())
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, fused=fused)
