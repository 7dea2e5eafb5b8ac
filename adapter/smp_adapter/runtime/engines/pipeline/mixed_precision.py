"""fp16 / bf16 with pipeline_parallel_degree > 1: fp32 master weights and loss scaling.

smp v1's fp16 is Apex fp16_utils (smp v1's ``fp16`` option): the model runs in fp16, the optimizer updates fp32
master copies, the loss is multiplied by a static or dynamic loss scale, and a step whose gradients
overflow is skipped. At pp = 1 DeepSpeed's fp16 optimizer does this; pp > 1 has no DeepSpeed engine,
so it is done here, with DeepSpeed's own loss scalers (same rules as at pp = 1):
  * ``DistributedModel`` casts the module to fp16 (bf16) before the stages are cut, and floating
    inputs follow (model.py);
  * the pipeline multiplies each microbatch loss by ``loss_scale`` (in fp32) before its backward;
  * on the first ``optimizer.step()`` (the model is partitioned by then) every parameter of this
    stage gets an fp32 master copy, and the torch optimizer's ``param_groups`` (and any state it
    already holds, e.g. from a checkpoint) are re-pointed from the fp16 parameter to its master, as
    Apex's FP16_Optimizer does. LR schedulers act on the same ``param_groups`` dicts and keep working;
  * ``step()``: overflow = an inf/nan in any gradient on any rank (one all-reduce over the world, so
    every rank takes the same decision). On overflow the step is skipped and the scaler lowers the
    scale; otherwise master gradients = fp16 gradients / scale, optional clipping, the optimizer
    steps the masters, and the masters are copied back into the fp16 parameters.
bf16 uses the same path with a loss scale of 1 (bf16 has fp32's exponent range).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PipelineMixedPrecision:
    def __init__(self, dtype: torch.dtype, loss_scale_args):
        from smp_adapter.runtime.engines.deepspeed.parts import make_loss_scaler

        self.dtype = dtype
        self.scaler = make_loss_scaler(dtype, loss_scale_args)
        self.params: list = []   # this stage's model parameters (fp16 / bf16)
        self.masters: list = []  # their fp32 master copies, in the same order
        self.overflow = False
        self._pending_masters: list | None = None  # from a checkpoint loaded before the first step
        self.pending_optimizer_state: dict | None = None  # idem: loaded once the masters exist

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.loss_scale)

    # -- masters -----------------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer, params: list) -> None:
        """Create the fp32 masters of ``params`` and re-point ``optimizer`` at them."""
        self.params = params
        self.masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in params]
        if self._pending_masters is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, self._pending_masters):
                    m.copy_(saved)
            self._pending_masters = None
        swap = {id(p): m for p, m in zip(params, self.masters)}
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        for p, m in zip(params, self.masters):  # state already there follows its parameter
            if p in optimizer.state:
                optimizer.state[m] = optimizer.state.pop(p)
        if self.pending_optimizer_state is not None:
            # loaded now, not before: torch casts optimizer state to the dtype of its parameter,
            # which was fp16 before the masters existed
            optimizer.load_state_dict(self.pending_optimizer_state)
            self.pending_optimizer_state = None

    @property
    def attached(self) -> bool:
        return bool(self.masters)

    def masters_by_param(self) -> dict:
        """id(model parameter) -> its fp32 master (empty until ``attach``)."""
        return dict(zip(map(id, self.params), self.masters))

    # -- step --------------------------------------------------------------------------------------
    def prepare_step(self) -> bool:
        """Overflow check over every rank, then fp32 master gradients = gradients / scale.
        Returns False (and lowers the scale) when the step must be skipped."""
        found = torch.zeros(())
        for p in self.params:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                found.fill_(1.0)
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.overflow = bool(found.item())
        if self.overflow:
            self.scaler.update_scale(True)
            for m in self.masters:
                m.grad = None
            return False
        inv = 1.0 / self.loss_scale
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().float().mul_(inv)
        return True

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def finish_step(self) -> None:
        """After the optimizer stepped the masters: copy them into the model's parameters."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
        self.scaler.update_scale(False)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        from smp_adapter.runtime.checkpoint.universal import scaler_fields

        return {"masters": [m.detach().clone() for m in self.masters], "scaler": scaler_fields(self.scaler)}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.get("scaler", {}).items():
            setattr(self.scaler, k, v)
        masters = sd.get("masters") or []
        if self.attached:
            with torch.no_grad():
                for m, saved in zip(self.masters, masters):
                    m.copy_(saved)
        else:
            self._pending_masters = list(masters)
