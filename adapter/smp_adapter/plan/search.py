"""``plan --search``: the job held fixed (model, cluster, global batch, optimizer), every layout that
realises it planned, those within usable memory minus the headroom kept, ranked by step time.

Every row trains the same number of samples per optimizer step, so step times compare directly.
The ranking is by predicted step time, strictly (equal step times: more memory left first). Rows
within TIME_TIE of the first are within the time model's error of it: the output marks them and
names the one of them with the most memory left, but does not reorder them (an earlier rule did,
and chained: a 6.57 s row ranked above a 6.43 s one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smp_adapter.plan import costs
from smp_adapter.plan.layouts import base_layouts, realisations

# relative step-time difference within which plan cannot tell two layouts apart (docs/plan.md, "How
# far to trust the time model": its error on the measured rows of the error table is of this order)
TIME_TIE = 0.05
DEFAULT_HEADROOM = 0.10  # device memory kept free for what the plan does not count


@dataclass
class Row:
    dims: object  # ParallelDims
    job: costs.Job
    plan: costs.Plan
    budget: int  # usable device bytes minus the headroom

    @property
    def memory_left(self) -> int:
        return self.budget - self.plan.peak_bytes

    @property
    def step_s(self) -> float:
        return self.plan.step_time_s


@dataclass
class SearchResult:
    global_batch: int
    budget: int
    ranked: list = field(default_factory=list)  # Rows that fit, fastest first
    layouts: int = 0  # layouts x checkpointing choices that realise the global batch
    planned: int = 0  # plans made (one per microbatch size)
    over_memory: list = field(default_factory=list)  # the best Row of each layout choice that fits nowhere


def search(spec, base: dict, cluster, global_batch: int, optimizer: str = "adam", headroom: float = DEFAULT_HEADROOM,
           checkpointing=(False, True), cross_node: bool = False, delayed_init: bool = False, top: int = 0) -> SearchResult:
    budget = int(cluster.allocatable * (1 - headroom))
    result = SearchResult(global_batch, budget)
    fitting = []
    world = cluster.world_size
    for options, sdp_engine in base_layouts(base, world, spec, cluster.gpus_per_node, cross_node):
        for ac in checkpointing:
            best = smallest = None
            for dims, batch, accumulation in realisations(options, world, global_batch, sdp_engine):
                job = costs.Job(batch, ac, optimizer, accumulation, delayed_init)
                planned = costs.plan(spec, dims, cluster, job)
                result.planned += 1
                row = Row(dims, job, planned, budget)
                if row.memory_left >= 0 and (best is None or _better(row, best)):
                    best = row
                if smallest is None or row.plan.peak_bytes < smallest.plan.peak_bytes:
                    smallest = row
            if smallest is None:
                continue  # this layout cannot realise the global batch
            result.layouts += 1
            if best is not None:
                fitting.append(best)
            else:
                result.over_memory.append(smallest)
    result.ranked = rank(fitting, top or len(fitting))
    return result


def _key(row: Row) -> tuple:
    """The one ranking rule: faster first; equal step times, more memory left first."""
    return row.step_s, -row.memory_left


def _better(row: Row, than: Row) -> bool:
    """Within one layout: the faster microbatch size (the ranking's own rule)."""
    return _key(row) < _key(than)


def rank(rows: list, top: int) -> list:
    """The ``top`` best rows by step time (_key)."""
    return sorted(rows, key=_key)[:top]


def within_tie(row: Row, first: Row) -> bool:
    """Whether ``row`` is within the time model's error (TIME_TIE) of the first row."""
    return row.step_s <= first.step_s * (1 + TIME_TIE)
