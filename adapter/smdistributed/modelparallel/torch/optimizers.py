"""smp.optimizers: replacements for the apex fused optimizers (spec §2.12, §5.8)."""

import torch

from smp_adapter.errors import UnsupportedFeatureError


class FusedAdam(torch.optim.AdamW):
    """apex FusedAdam semantics (decoupled weight decay, adam_w_mode=True) on torch's AdamW;
    torch's fused kernel is used on CUDA."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, **kwargs):
        if not bias_correction or not adam_w_mode:
            raise UnsupportedFeatureError("FusedAdam(bias_correction=False / adam_w_mode=False) is not supported: "
                                          "use torch.optim.Adam for L2-regularised Adam")
        fused = kwargs.pop("fused", torch.cuda.is_available())
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, fused=fused)


def FusedLAMB(params, *args, **kwargs):
    if not torch.cuda.is_available():
        raise UnsupportedFeatureError("FusedLAMB needs a CUDA GPU (DeepSpeed's fused LAMB kernel): on CPU use "
                                      "torch.optim.AdamW")
    from deepspeed.ops.lamb import FusedLamb

    return FusedLamb(params, *args, **kwargs)


FusedLamb = FusedLAMB


def FusedNovoGrad(params, *args, **kwargs):
    raise UnsupportedFeatureError("FusedNovoGrad has no DeepSpeed/torch equivalent here: use torch.optim.AdamW "
                                  "(or FusedAdam)")
