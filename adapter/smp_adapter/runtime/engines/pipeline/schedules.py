"""torch.distributed.pipelining schedules, extended with the two things smp's step needs.

torch's public ``schedule.step(*args, target=...)`` takes whole batches and splits them itself; smp
has split the batch already (the step function's arguments, microbatch by microbatch) and computes
the loss with the user's own step body, which changes every call. Each schedule class used here is
subclassed to run already-split microbatches with a given loss function (``run_microbatches``) and
to make the stage set up its buffers again after another schedule used it (``reset_stage_setup``).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def smp_schedule_class(base: type) -> type:
    """``base`` (a single-stage torch schedule class) with smp's entry points."""

    class SMPSchedule(base):
        def run_microbatches(self, arg_mbs: list, kwarg_mbs: list, loss_fn=None, targets=None) -> None:
            if loss_fn is not None:
                self._loss_fn = loss_fn
            self._step_microbatches(arg_mbs, kwarg_mbs, targets, None)

        def reset_stage_setup(self) -> None:
            self._stage_forward_initialized = self._stage_backward_initialized = False

    SMPSchedule.__name__ = SMPSchedule.__qualname__ = f"SMP{base.__name__}"
    return SMPSchedule


def make_schedule(stage, num_microbatches: int, training: bool, simple: bool, num_stages: int):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import _ScheduleForwardOnly

    if not training:
        return smp_schedule_class(_ScheduleForwardOnly)(stage, num_microbatches)
    # with fewer microbatches than stages 1F1B never reaches a steady state: GPipe is the same order
    base = ScheduleGPipe if simple or num_microbatches < num_stages else Schedule1F1B
    # loss_fn is replaced per call; scaling is done on the loss (smp's average)
    return smp_schedule_class(base)(stage, num_microbatches, loss_fn=lambda o, t: o, scale_grads=False)
