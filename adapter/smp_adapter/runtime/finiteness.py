"""Finiteness checks, so that no job trains on NaN to exit status 0 (DeepSpeed skips every step as
an "overflow" and says no more; plain data parallelism turns every weight NaN).

* Once: the weights right after ``DistributedModel`` (each rank reads what it holds: a ZeRO-3
  parameter's local shard, a tensor-parallel slice; one all-gather of a name per rank so that every
  rank stops together), and the first loss given to ``DistributedModel.backward``.
* Every optimizer step (``StepGuard``): the losses the step gave ``backward`` and DeepSpeed's overflow
  flag, under the policy ``SMP_ADAPTER_NON_FINITE`` (stop | skip | off).
* Every ``save_checkpoint``: the parameters, so a checkpoint of NaN weights is never written or named
  ``newest`` (and retention never deletes a good one for it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

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
                if data is not None and not _all_finite(data):
                    return f"{kind} {name}"
    return None


FINITE_CHUNK = 2**20  # elements checked at a time


def _all_finite(data: torch.Tensor) -> bool:
    """``torch.isfinite(data).all()`` a chunk at a time: torch computes isfinite through a float
    ``abs()`` and two boolean tensors of the input's size, which for a 4M-element embedding shard
    was a 29 MiB peak in smp.DistributedModel (benchmarks/RESULTS.md §18.2)."""
    if not data.is_floating_point() and not data.is_complex():
        return True
    flat = data.reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHUNK))


def _gather_non_finite(module: nn.Module, local_data) -> list[tuple[int, str]]:
    """(rank, first non-finite tensor) of every rank holding one, on every rank."""
    import torch.distributed as dist

    found = first_non_finite_tensor(module, local_data)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
    else:
        everyone = [found]
    return [(rank, name) for rank, name in enumerate(everyone) if name]


def check_initial_weights(module: nn.Module, local_data=None) -> None:
    """Raise on every rank when any rank holds a non-finite parameter or buffer."""
    bad = _gather_non_finite(module, local_data)
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


# -- every step: the losses given to DistributedModel.backward, DeepSpeed's overflow flag ------------------------
POLICY_ENV = "SMP_ADAPTER_NON_FINITE"  # stop (default) | skip | off
MAX_SKIPS_ENV = "SMP_ADAPTER_MAX_SKIPPED_STEPS"  # the "skip" policy stops after this many in a row
DEFAULT_MAX_SKIPS = 10
_POLICIES = ("stop", "skip", "off")


@dataclass(frozen=True)
class NonFinitePolicy:
    action: str = "stop"
    max_skips: int = DEFAULT_MAX_SKIPS


def policy_from_env(environ) -> NonFinitePolicy:
    action = environ.get(POLICY_ENV, "stop").strip().lower() or "stop"
    raw = environ.get(MAX_SKIPS_ENV, "").strip()
    if action not in _POLICIES:
        raise SMPUsageError(f"{POLICY_ENV}={action!r}: must be one of {', '.join(_POLICIES)} (stop: raise at the first "
                            "non-finite loss; skip: skip such steps, stop after "
                            f"{MAX_SKIPS_ENV} in a row; off: no per-step check)")
    if raw and not (raw.isdigit() and int(raw) > 0):
        raise SMPUsageError(f"{MAX_SKIPS_ENV}={raw!r}: must be a positive integer (steps skipped in a row before the "
                            f"job stops), e.g. {MAX_SKIPS_ENV}={DEFAULT_MAX_SKIPS}")
    return NonFinitePolicy(action, int(raw) if raw else DEFAULT_MAX_SKIPS)


class StepGuard:
    """Per-step finiteness of what the step already reduced: the losses the step gave
    ``DistributedModel.backward`` (one ``isfinite`` over them; under "skip" also one scalar all-reduce,
    so every rank takes the same decision) and, after the update, DeepSpeed's overflow flag
    outside fp16 (with fp32/bf16 an "overflow" is a NaN/inf gradient, which DeepSpeed would skip
    silently at every step). fp16's own overflows are the loss scaler's business and not counted."""

    def __init__(self, policy: NonFinitePolicy, loss_scaling: bool):
        self.policy, self.loss_scaling = policy, loss_scaling
        self.losses: list = []
        self.step = 0  # optimizer steps so far (1 = the first optimizer.step())
        self.skipped_in_a_row = 0

    def note_loss(self, loss) -> None:
        if self.policy.action != "off" and isinstance(loss, torch.Tensor) and loss.is_floating_point():
            self.losses.append(loss.detach())

    def forget_losses(self) -> None:
        """``optimizer.zero_grad()``: the losses of gradients just dropped are not this step's (a loss
        scaler such as smp.amp.GradScaler skipped the update of an overflowing step without calling
        optimizer.step(): its inf loss is the scaler's business)."""
        self.losses = []

    def before_update(self) -> bool:
        """Whether the optimizer should update (False: skip this step). Raises under "stop"."""
        self.step += 1
        losses, self.losses = self.losses, []
        if self.policy.action == "off":
            return True
        bad = bool(losses) and not bool(torch.isfinite(torch.cat([l.float().reshape(-1) for l in losses])).all())
        if self.policy.action == "stop":
            # no communication: the rank that saw it raises, and the launcher ends the job (its peers
            # fail their next collective); the NaN never reaches the weights on this rank, and a peer's
            # NaN update never reaches a checkpoint (save_checkpoint checks the weights)
            if bad:
                self._non_finite(f"the loss given to model.backward is not finite ({_first_non_finite(losses)}) on "
                                 f"rank {state.rank}")
            return True
        first_bad = _lowest_rank_with(bad)  # skipping needs every rank's agreement: one scalar all-reduce
        if first_bad is None:
            return True
        seen = f"({_first_non_finite(losses)}) " if bad else ""
        self._non_finite(f"the loss given to model.backward is not finite {seen}on rank {first_bad}"
                         + (" (the lowest rank that saw it)" if state.world_size > 1 else ""))
        return False

    def after_update(self, overflow: bool, updated: bool) -> None:
        if not updated or self.policy.action == "off":
            return
        if overflow and not self.loss_scaling:
            self._non_finite(f"a gradient is not finite (NaN/inf) on rank {state.rank}: DeepSpeed skipped the update "
                             "as an overflow, with no fp16 loss scale to lower")
        else:
            self.skipped_in_a_row = 0

    def _non_finite(self, what: str) -> None:
        fix = ("check that step's batch (labels all ignored, e.g. -100, give NaN; empty or corrupt samples), lower the "
               "learning rate or clip gradients (optimizer.clip_master_grads), prefer bf16 to fp16")
        if self.policy.action == "stop":
            raise SMPUsageError(f"optimizer step {self.step} (call {self.step} of optimizer.step()): {what}. The job "
                                f"stops instead of training on NaN; {fix}. {POLICY_ENV}=skip skips such steps "
                                f"instead (up to {MAX_SKIPS_ENV} in a row)")
        self.skipped_in_a_row += 1
        if state.rank == 0:
            print(f"smp-adapter: warning: optimizer step {self.step}: {what}; the update was skipped "
                  f"({self.skipped_in_a_row} in a row, the job stops at {self.policy.max_skips})",
                  file=sys.stderr, flush=True)
        if self.skipped_in_a_row >= self.policy.max_skips:
            raise SMPUsageError(f"{self.skipped_in_a_row} optimizer steps in a row were skipped as non-finite, the last "
                                f"at step {self.step}: {what}. Training is not progressing; {fix} "
                                f"({MAX_SKIPS_ENV} sets how many skips in a row are tolerated)")


def _first_non_finite(losses: list) -> float:
    flat = torch.cat([l.float().reshape(-1) for l in losses])
    return flat[~torch.isfinite(flat)][0].item()


def _lowest_rank_with(bad: bool) -> int | None:
    """The lowest rank whose ``bad`` is true, on every rank (one scalar all-reduce over the world)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return state.rank if bad else None
    world = dist.get_world_size()
    device = "cpu" if dist.get_backend() == "gloo" else state.device
    flag = torch.tensor([float(state.rank if bad else world)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    lowest = int(flag.item())
    return None if lowest >= world else lowest


# -- checkpoints: never written from non-finite parameters --------------------------------------------------------
def refuse_non_finite_checkpoint(module: nn.Module, local_data, where) -> None:
    """Raise SMPCheckpointError on every rank, before anything is written, when any rank holds a
    non-finite parameter or buffer (one all-gather of a name per rank)."""
    from smp_adapter.errors import SMPCheckpointError

    bad = _gather_non_finite(module, local_data)
    if bad:
        rank, name = bad[0]
        raise SMPCheckpointError(
            f"not saving the checkpoint to {where}: the model holds non-finite values (NaN/inf), first {name} on rank "
            f"{rank}. The existing checkpoints (and 'newest') are left as they were: resume from the newest one "
            "(smp.resume_from_checkpoint) and look at the steps since it")
