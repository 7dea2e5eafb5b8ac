"""Adam, LAMB and NovoGrad with apex's semantics, in plain PyTorch (``smp.optimizers.FusedAdam`` /
``FusedLAMB`` / ``FusedLamb`` / ``FusedNovoGrad``, and ``apex.optimizers.FusedAdam`` / ``FusedLAMB``
where NVIDIA apex is not installed: smp_adapter/apex_fallback).

smp v1's optimizers were apex's fused kernels. apex does not install without a CUDA toolchain, and
DeepSpeed's ``FusedLamb`` kernel computes a different update (its trust ratio is clamped to
[min_coeff, max_coeff] and it has no global-norm clipping), so these are written out from apex's
definitions and run on any device. They are per-tensor loops of a few elementwise ops: on small
models the cost is Python overhead, on large ones memory traffic, as for unfused Adam.

FusedLAMB, one step (apex ``multi_tensor_lamb``, t = step count):
  g <- g / max(1, ||g_all|| / max_grad_norm)          global clipping over every parameter (max_grad_norm > 0)
  g <- g + wd * p                                      only when adam_w_mode is False (L2)
  m <- b1 m + (1 - b1 if grad_averaging else 1) g;  v <- b2 v + (1 - b2) g^2
  u <- (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) (bias correction optional)
  u <- u + wd * p                                      when adam_w_mode (decoupled)
  r <- ||p|| / ||u|| when both are > 0 and (wd != 0 or use_nvlamb), else 1
  p <- p - lr * r * u

FusedNovoGrad, one step (apex ``multi_tensor_novograd``, per tensor = per layer):
  n <- ||g||^2;  v <- n at the first step (0 with init_zero), else b2 v + (1 - b2) n
  d <- g / (sqrt(v / (1 - b2^t)) + eps)                (bias correction optional)
  d <- d + wd * p                                      when reg_inside_moment
  m <- b1 m + (1 - b1 if grad_averaging else 1) d
  u <- m / (1 - b1^t), plus wd * p when not reg_inside_moment
  p <- p - lr * u
"""

from __future__ import annotations

import torch

from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError


def _check_betas(name, betas, eps):
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise SMPUsageError(f"{name}: betas must be in [0, 1), got {betas}")
    if eps < 0:
        raise SMPUsageError(f"{name}: eps must be >= 0, got {eps}")


class FusedLAMB(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        if amsgrad:
            raise UnsupportedFeatureError("FusedLAMB(amsgrad=True) is not supported (nor by apex): remove it")
        _check_betas("FusedLAMB", betas, eps)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode, self.use_nvlamb, self.set_grad_none = adam_w_mode, use_nvlamb, set_grad_none

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        if any(g.is_sparse for g in grads):
            raise UnsupportedFeatureError("FusedLAMB does not support sparse gradients: use dense embeddings")
        global_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        for group in self.param_groups:
            b1, b2 = group["betas"]
            max_norm = group["max_grad_norm"]
            clip = torch.clamp(global_norm / max_norm, min=1.0) if max_norm > 0 else torch.ones(())
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t, wd, w = state["step"], group["weight_decay"], p.float()
                g = p.grad.float() / clip
                if not self.adam_w_mode and wd != 0:
                    g = g + wd * w
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode and wd != 0:
                    update = update + wd * w
                ratio = 1.0
                if wd != 0 or self.use_nvlamb:
                    w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(update)
                    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.copy_((w - group["lr"] * ratio * update).to(p.dtype))
        return loss


class FusedNovoGrad(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
                 set_grad_none=True):
        if amsgrad:
            raise UnsupportedFeatureError("FusedNovoGrad(amsgrad=True) is not supported (nor by apex): remove it")
        if norm_type != 2:
            raise UnsupportedFeatureError(f"FusedNovoGrad(norm_type={norm_type}): only the L2 norm (norm_type=2) is "
                                          "supported")
        _check_betas("FusedNovoGrad", betas, eps)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging)
        super().__init__(params, defaults)
        self.reg_inside_moment, self.init_zero, self.set_grad_none = reg_inside_moment, init_zero, set_grad_none

    def zero_grad(self, set_to_none: bool | None = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise UnsupportedFeatureError("FusedNovoGrad does not support sparse gradients")
                state = self.state[p]
                g, w, wd = p.grad.float(), p.float(), group["weight_decay"]
                norm_sq = g.pow(2).sum()
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros((), device=p.device) if self.init_zero else norm_sq.clone()
                    if self.init_zero:
                        state["exp_avg_sq"].add_(norm_sq, alpha=1 - b2)
                else:
                    state["exp_avg_sq"].mul_(b2).add_(norm_sq, alpha=1 - b2)
                state["step"] += 1
                t = state["step"]
                c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)
                d = g / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
                if self.reg_inside_moment and wd != 0:
                    d = d + wd * w
                m = state["exp_avg"]
                m.mul_(b1).add_(d, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
                update = m / c1
                if not self.reg_inside_moment and wd != 0:
                    update = update + wd * w
                p.copy_((w - group["lr"] * update).to(p.dtype))
        return loss


class FusedAdam(torch.optim.AdamW):
    """apex FusedAdam semantics (decoupled weight decay, adam_w_mode=True) on torch's AdamW;
    adam_w_mode=False (L2 regularisation) is torch's Adam. torch's fused kernel where every parameter
    is a floating CUDA tensor (runtime/kernels.py ``prefer_fused``), unless ``fused=`` / ``foreach=``
    is given; on CPU torch's default implementation (translate/kernels.py says what each becomes)."""

    def __new__(cls, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                weight_decay=0.0, amsgrad=False, **kwargs):
        if not bias_correction:
            raise UnsupportedFeatureError("FusedAdam(bias_correction=False) is not supported: torch's Adam always "
                                          "corrects the moment bias; remove the argument")
        if adam_w_mode:
            return super().__new__(cls)
        return _fused_where_possible(torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                      amsgrad=amsgrad, **_torch_kwargs(kwargs)))

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **_torch_kwargs(kwargs))
        _fused_where_possible(self)


def _torch_kwargs(kwargs: dict) -> dict:
    # fused= / foreach= are the script's choice of torch kernel; apex's other knobs (set_grad_none,
    # capturable, master_weights) have no torch Adam counterpart and are accepted without effect, as before
    return {k: kwargs[k] for k in ("fused", "foreach") if k in kwargs}


def _fused_where_possible(optimizer):
    from smp_adapter.runtime.kernels import prefer_fused

    prefer_fused(optimizer)
    return optimizer
