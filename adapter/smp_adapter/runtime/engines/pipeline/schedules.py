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
    """``base`` (a torch schedule class, one or several stages per rank) with smp's entry points."""

    class SMPSchedule(base):
        def run_microbatches(self, arg_mbs: list, kwarg_mbs: list, loss_fn=None, targets=None) -> None:
            if loss_fn is not None:
                self._loss_fn = loss_fn
            self._step_microbatches(arg_mbs, kwarg_mbs, targets, None)

        def reset_stage_setup(self) -> None:
            from smp_adapter.runtime.engines.pipeline.torch_compat import forget_output_meta

            self._stage_forward_initialized = self._stage_backward_initialized = False  # single stage
            self._stages_forward_initialized = self._stages_backward_initialized = False  # several
            for stage in getattr(self, "_stages", None) or [self._stage]:
                forget_output_meta(stage)

    SMPSchedule.__name__ = SMPSchedule.__qualname__ = f"SMP{base.__name__}"
    return SMPSchedule


def make_schedule(stages: list, num_microbatches: int, training: bool, schedule: str, num_ranks: int):
    """The torch schedule for ``pipeline: <schedule>`` over this rank's stages (one for smp's
    schedules and zero_bubble at v = 1, several otherwise; config/pipeline_schedule.py)."""
    import torch.distributed.pipelining.schedules as S

    from smp_adapter.config.pipeline_schedule import TORCH_CLASS

    if schedule in ("interleaved", "simple", "_only_forward"):
        (stage,) = stages
        if not training:
            return smp_schedule_class(S._ScheduleForwardOnly)(stage, num_microbatches)
        # with fewer microbatches than stages 1F1B never reaches a steady state: GPipe is the same order
        simple = schedule == "simple" or num_microbatches < num_ranks
        base = S.ScheduleGPipe if simple else S.Schedule1F1B
        # loss_fn is replaced per call; scaling is done on the loss (smp's average)
        return smp_schedule_class(base)(stage, num_microbatches, loss_fn=lambda o, t: o, scale_grads=False)
    base = getattr(S, TORCH_CLASS[schedule])
    if not training:
        return smp_schedule_class(_forward_only_multi())(stages, num_microbatches, scale_grads=False)
    # scale_grads=False: the loss is scaled instead (smp's average over microbatches; torch's grad
    # scaling averages wrongly under gradient accumulation, torchtitan #1732)
    return smp_schedule_class(base)(stages, num_microbatches, loss_fn=lambda o, t: o, scale_grads=False)


@functools.lru_cache(maxsize=None)
def _forward_only_multi() -> type:
    import torch.distributed.pipelining.schedules as S

    class ForwardOnlyMulti(S._PipelineScheduleRuntime):
        """Evaluation with several stages per rank: every rank runs its stages' forwards stage by
        stage, all microbatches each (breadth first; sends are asynchronous, so no rank waits on one
        that waits on it). torch's training schedules cannot run without their backward (the V
        schedules hand input gradients between a rank's two stages even then)."""

        def __init__(self, stages, n_microbatches, **kw):
            self.pp_group_size = stages[0].group_size
            ranks = dict(stages[0].stage_index_to_group_rank)  # looped or V (the base class resets it to looped)
            super().__init__(stages=stages, n_microbatches=n_microbatches, **kw)
            for stage in stages:
                stage.stage_index_to_group_rank = ranks
            order = {r: [S._Action(st, S.FORWARD, mb) for st in sorted(ranks) if ranks[st] == r
                         for mb in range(n_microbatches)] for r in sorted(set(ranks.values()))}
            self.pipeline_order = order
            # torch's lowering (_prepare_schedule_with_comms) without its check, which wants a backward
            # for every forward: the stage -> rank mapping is the stages' own, sends/receives added
            self.stage_index_to_group_rank = dict(ranks)
            self.pipeline_order_with_comms = S._add_send_recv(
                {r: S._add_unshard_reshard(acts) for r, acts in order.items()},
                stage_to_rank=lambda st: self.stage_index_to_group_rank[st], num_stages=self._num_stages)

    return ForwardOnlyMulti

