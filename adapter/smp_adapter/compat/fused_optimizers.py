"""Adam, LAMB and NovoGrad with apex's semantics, in plain PyTorch (``smp.optimizers.FusedAdam`` /
``FusedLAMB`` / ``FusedLamb`` / ``FusedNovoGrad``, and ``apex.optimizers.FusedAdam`` / ``FusedLAMB``
where NVIDIA apex is not installed: smp_adapter/compat/apex_fallback).

smp v1's optimizers were apex's fused kernels. apex does not install without a CUDA toolchain, and
DeepSpeed's ``FusedLamb`` kernel computes a different update (its trust ratio is clamped to
[min_coeff, max_coeff] and it has no global-norm clipping), so these are written out from apex's
definitions and run on any device, with torch's multi-tensor ``_foreach`` ops (torch has no fused or
foreach LAMB / NovoGrad of its own): each step is a few kernels per parameter group, as torch's
foreach Adam, instead of a dozen per tensor. NovoGrad's per-layer division is still one op per tensor.

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
        # multi-tensor (torch._foreach_*) ops: a few kernels per group and step instead of ~12 per tensor
        global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            max_norm, wd, lr = group["max_grad_norm"], group["weight_decay"], group["lr"]
            clip = torch.clamp(global_norm / max_norm, min=1.0) if max_norm > 0 else torch.ones(())
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
            steps = [self.state[p]["step"] for p in params]
            m, v = [self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params]
            w = [p.float() for p in params]  # read only: for float32 parameters these are the parameters
            g = torch._foreach_div([p.grad.float() for p in params], clip.to(grads[0].device))
            if not self.adam_w_mode and wd != 0:
                g = torch._foreach_add(g, w, alpha=wd)
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, g, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, g, g, value=1 - b2)
            bias = group["bias_correction"]
            denom = torch._foreach_div(v, [1 - b2 ** t if bias else 1.0 for t in steps])
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, [1 - b1 ** t if bias else 1.0 for t in steps])
            torch._foreach_div_(update, denom)
            if self.adam_w_mode and wd != 0:
                torch._foreach_add_(update, w, alpha=wd)
            if wd != 0 or self.use_nvlamb:  # trust ratio ||w|| / ||u|| per tensor, 1 where either is 0
                w_norm = torch.stack(torch._foreach_norm(w))
                u_norm = torch.stack(torch._foreach_norm(update))
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                torch._foreach_mul_(update, list((lr * ratio).unbind()))
            else:
                torch._foreach_mul_(update, lr)
            torch._foreach_copy_(params, torch._foreach_sub(w, update))
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
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise UnsupportedFeatureError("FusedNovoGrad does not support sparse gradients")
            wd = group["weight_decay"]
            g = [p.grad.float() for p in params]
            w = [p.float() for p in params]  # read only: for float32 parameters these are the parameters
            norm_sq = torch._foreach_norm(g)  # per tensor (per layer); squared next
            torch._foreach_mul_(norm_sq, norm_sq)
            for p, n in zip(params, norm_sq):
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros((), device=p.device) if self.init_zero else n.clone()
                    if self.init_zero:
                        state["exp_avg_sq"].add_(n, alpha=1 - b2)
                else:
                    state["exp_avg_sq"].mul_(b2).add_(n, alpha=1 - b2)
                state["step"] += 1
            steps = [self.state[p]["step"] for p in params]
            bias = group["bias_correction"]
            denom = torch._foreach_div([self.state[p]["exp_avg_sq"] for p in params],
                                       [1 - b2 ** t if bias else 1.0 for t in steps])
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            d = [gi / di for gi, di in zip(g, denom)]  # a tensor by its 0-d denominator (foreach needs equal shapes)
            if self.reg_inside_moment and wd != 0:
                torch._foreach_add_(d, w, alpha=wd)
            m = [self.state[p]["exp_avg"] for p in params]
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, d, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
            update = torch._foreach_div(m, [1 - b1 ** t if bias else 1.0 for t in steps])
            if not self.reg_inside_moment and wd != 0:
                torch._foreach_add_(update, w, alpha=wd)
            torch._foreach_mul_(update, group["lr"])
            torch._foreach_copy_(params, torch._foreach_sub(w, update))
        return loss


class FusedAdam(torch.optim.AdamW):
    """apex FusedAdam semantics (decoupled weight decay, adam_w_mode=True) on torch's AdamW;
    adam_w_mode=False (L2 regularisation) is torch's Adam. torch's fused kernel where every parameter
    is a floating CUDA tensor (``prefer_fused`` below), unless ``fused=`` / ``foreach=``
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
    prefer_fused(optimizer)
    return optimizer


def fused_supported(params, device_types=("cuda",)) -> bool:
    """torch's fused Adam kernel applies: every parameter a floating tensor on one of ``device_types``."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    usable = set(device_types) & set(_get_fused_kernels_supported_devices())
    params = list(params)
    return bool(params) and all(p.device.type in usable and p.dtype.is_floating_point and not p.is_sparse
                                for p in params)


def prefer_fused(optimizer, device_types=("cuda",)) -> bool:
    """Switch a torch Adam/AdamW (smp.optimizers.FusedAdam is one) whose groups left ``fused`` and
    ``foreach`` unset to fused=True when every parameter is a floating tensor on a device in
    ``device_types`` (CUDA), before its first step: the same update within float32 rounding, in one
    kernel instead of torch's default there (foreach). smp.DistributedOptimizer calls it too, for the
    optimizer a script built. True when switched."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return False  # the script chose (or differentiable, which fused refuses): keep it
    if not fused_supported([p for g in groups for p in g["params"]], device_types):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    # not _step_supports_amp_scaling (Adam.__init__(fused=True) sets it): a GradScaler then unscales
    # first, as for the optimizer the script built (and smp.amp.GradScaler agrees on overflows there)
    return True
