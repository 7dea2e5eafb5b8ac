"""fp16 on the MiCS engine: smp v1's loss scaling over FSDP2's shards.

FSDP2's mixed precision gathers and computes in fp16 while the shards stay fp32 and the gradients are
reduced in fp32 into fp32 gradient shards: the fp32 masters that Apex's FP16_Optimizer or DeepSpeed keep
beside an fp16 model are the shards themselves. What this adds is the scale, with DeepSpeed's loss
scalers built from smp.DistributedOptimizer's arguments (the same rules as ZeRO-3 and the pipeline engine):

* backward: the loss, in fp32 (the scale may exceed fp16's range), times the current scale;
* before the update, or before a clip of the model's gradients ahead of it (once per step): overflow = a
  NaN/inf in any gradient shard on any rank, one scalar all-reduce over the world so that every rank takes
  the same decision. On an overflow the update is skipped, the gradients are dropped and the scaler lowers
  the scale (``hysteresis``/``delayed_shift``, ``min_scale``); otherwise every gradient shard is divided by
  the scale, the optimizer steps, and the scaler counts a good step (growing the scale after
  ``scale_window`` of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardLossScaler:
    def __init__(self, loss_scale_args, device):
        from smp_adapter.runtime.engines.deepspeed.parts import make_loss_scaler
        from smp_adapter.runtime.engines.deepspeed.process_group import join_started_group

        if dist.is_initialized():
            join_started_group()  # DeepSpeed's scaler logs an overflow through its communication layer
        self.scaler = make_loss_scaler(torch.float16, loss_scale_args)
        self.overflow = False  # the last step's verdict (read as optimizer.overflow)
        self._verdict = None   # this step's, once taken: True = unscaled and fit to apply, False = overflow
        self._device = device  # the job's: where the overflow flag is all-reduced

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.loss_scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.loss_scale

    def unscale(self, grads) -> bool:
        """Whether this step's gradients are fit to apply; the first call of a step checks every rank's
        gradient shards (``grads``: this rank's, local tensors) for NaN/inf and, when none has any, divides
        them by the scale."""
        if self._verdict is not None:
            return self._verdict
        found = torch.zeros((), dtype=torch.float32, device=self._device)
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            found.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank joins, whatever it found
        self.overflow = bool(found.item())
        if not self.overflow:
            inv = 1.0 / self.loss_scale
            with torch.no_grad():
                for g in grads:
                    g.mul_(inv)
        self._verdict = not self.overflow
        return self._verdict

    def finish_step(self, params) -> None:
        """After the update, or in place of it: a skipped step's gradients are dropped; the scale moves."""
        if self.overflow:
            for p in params:
                p.grad = None
        self.scaler.update_scale(self.overflow)
        self._verdict = None
