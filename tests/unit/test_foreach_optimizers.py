"""smp.optimizers.FusedLAMB / FusedNovoGrad on torch's multi-tensor (_foreach) ops, against the
per-tensor loops they replaced (apex's definitions written out op by op, kept here as the reference;
tests/unit/test_client_names.py checks both against apex's formulas by hand). Every option that
changes the update is exercised, float32 and bfloat16 parameters, over 4 steps.

Tolerance: float32 weights within 1e-6 absolute (1e-5 relative): the foreach ops do the same
operations, but norms are summed in another order (and NovoGrad's squared norm is a squared square
root), which moves LAMB's trust ratio and NovoGrad's per-layer denominator by ~1e-7 relative; over 4
steps of lr 0.1 that is a few 1e-7 on the weights (3e-7 seen). bfloat16 parameters: the update is computed in float32 from the same float32
state and rounded to bfloat16 once, so equal within one bfloat16 ulp (2^-8 relative)."""

import itertools

import pytest
import torch

from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.compat.fused_optimizers import FusedLAMB, FusedNovoGrad


class LoopLAMB(FusedLAMB):
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


class LoopNovoGrad(FusedNovoGrad):
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


def _run(cls, dtype, steps=4, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in ((6, 5), (5,), (3, 2, 2))]
    params.append(torch.nn.Parameter(torch.zeros(4, dtype=dtype)))  # ||w|| = 0: trust ratio 1
    opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.05}], lr=0.1, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
        params[1].grad = None if _ == 1 else params[1].grad  # a parameter without a gradient at one step
        opt.step()
    return [p.detach().float() for p in params]


def _close(got, want, dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


LAMB_OPTIONS = [dict(zip(("adam_w_mode", "use_nvlamb", "grad_averaging", "bias_correction", "weight_decay",
                          "max_grad_norm"), values))
                for values in itertools.product((True, False), (False, True), (True, False), (True, False),
                                                (0.0, 0.01), (1.0, 0.0))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_lamb_equals_the_per_tensor_loop(dtype):
    for options in LAMB_OPTIONS:
        _close(_run(FusedLAMB, dtype, **options), _run(LoopLAMB, dtype, **options), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_novograd_equals_the_per_tensor_loop(dtype):
    for values in itertools.product((False, True), (True, False), (True, False), (0.0, 0.001), (False, True)):
        options = dict(zip(("reg_inside_moment", "grad_averaging", "bias_correction", "weight_decay", "init_zero"),
                           values))
        _close(_run(FusedNovoGrad, dtype, **options), _run(LoopNovoGrad, dtype, **options), dtype)


def test_sparse_gradients_are_refused():
    p = torch.nn.Parameter(torch.randn(3, 2))
    p.grad = torch.randn(3, 2).to_sparse()
    for cls in (FusedLAMB, FusedNovoGrad):
        with pytest.raises(UnsupportedFeatureError, match="sparse"):
            cls([p]).step()
