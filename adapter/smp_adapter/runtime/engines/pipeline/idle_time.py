"""Each pipeline rank's measured idle fraction: the part of a step's schedule this rank spends
neither computing nor in its step body, i.e. waiting for its neighbours' activations and gradients
(the bubble) and moving them (send/recv over the process group).

``ComputeClock`` times this rank's compute actions (its stages' forward, backward and, for the
split-backward schedules, weight-gradient chunks, and the loss = the step body on the last stage)
and the wall time of each schedule run. Per training step: idle fraction = 1 - busy / wall. It is
always on (one perf_counter pair per action); the communication ledger records it per step
(ledger/record.py) and `smp-adapter report` prints it per rank next to the schedule's bubble
formula (config/pipeline_schedule.py).
"""

from __future__ import annotations

import time

ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class ComputeClock:
    def __init__(self, stages: list):
        self.busy = 0.0  # seconds of compute in the current step
        self.wall = 0.0  # seconds of schedule runs in the current step
        self.steps: list[tuple[float, float]] = []  # (wall, busy) of each finished training step
        self.watch(stages)

    def watch(self, stages: list) -> None:
        """Time these stages' compute too (the stages built for another set of model inputs)."""
        for stage in stages:
            for name in ACTIONS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), "busy"))

    def _timed(self, fn, counter: str):
        """``fn``, adding the seconds each call takes to ``self.<counter>`` ("busy" or "wall")."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

        return timed

    def attach(self, schedule) -> None:
        """Time this schedule's runs (wall) and its loss computation (the step body on the last
        stage, counted as compute)."""
        schedule._maybe_compute_loss = self._timed(schedule._maybe_compute_loss, "busy")
        schedule.run_microbatches = self._timed(schedule.run_microbatches, "wall")

    def finish_step(self, training: bool) -> tuple[float, float] | None:
        """Close the step: (wall, busy) of a training step (None for evaluation), counters reset."""
        done = (self.wall, self.busy) if training else None
        if done is not None:
            self.steps.append(done)
            del self.steps[:-1000]  # bounded: a long job keeps its recent steps
        self.wall = self.busy = 0.0
        return done


def idle_fraction(wall: float, busy: float) -> float:
    return max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0
