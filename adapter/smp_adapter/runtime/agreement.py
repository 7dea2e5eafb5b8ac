"""Ranks agree on whether a phase that may fail on one rank alone succeeded, before any rank goes on.

Why: a rank whose write fails (a full disk) and raises at once leaves the other ranks inside the phase's
next collective while it enters another one (its error's, or the next step's); gloo then aborts the
process (``op.preamble.length <= op.nbytes``, SIGABRT) before any error is printed. So a phase that may
fail locally catches the failure, finishes the collectives every rank runs, and then every rank calls
``agree_on_failure``: one all-reduce of a status (a second collective, the errors themselves, only when
some rank failed), after which every rank raises (``raise_agreed``): the failing rank its own error, the
others one naming that rank and its cause.

Belt and braces: before it enters the agreement a failing rank writes its cause to the launcher's channel
(``CAUSE_DIR_ENV``, a folder of the job that ``smp-adapter launch`` sets and reads), so that when a rank is
killed before it could print (a collective mismatch this module does not know of), the launcher still
names the first cause (launch/supervisor.py).

``max_over_ranks`` is also the resume's digest verdict (checkpoint/integrity/resume_check.py): one home
for these small CPU collectives.
"""

from __future__ import annotations

import os
from pathlib import Path

from smp_adapter.launch.rank_env import CAUSE_DIR_ENV


def max_over_ranks(values: list[int], world_size: int) -> list[int]:
    """Element-wise maximum of ``values`` (the same length on every rank) over all ranks (collective):
    one all-reduce of a small tensor, about a third of an all_gather_object's cost (which pickles,
    and runs two collectives). On smp's CPU group for such bookkeeping (``state.groups.objects``:
    gloo over the world, NCCL jobs too), so the tensor stays on the CPU."""
    if world_size == 1 or not values:
        return list(values)
    import torch
    import torch.distributed as dist

    from smp_adapter.runtime.state import state

    reduced = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=_objects_group(state))
    return reduced.tolist()


def _objects_group(state):
    return state.groups.objects if state.initialized else None


def report_cause(error: str) -> None:
    """Write this rank's cause where the launcher reads it (no launcher channel: nothing to do). Never
    raises: the disk that failed the save may be the one the job directory is on."""
    folder = os.environ.get(CAUSE_DIR_ENV)
    if not folder:
        return
    from smp_adapter.runtime.state import state

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = Path(folder) / f".rank{state.rank}.txt.tmp"
        tmp.write_text(error + "\n")
        os.replace(tmp, Path(folder) / f"rank{state.rank}.txt")
    except OSError:
        pass


def agree_on_failure(error: str | None, world_size: int, error_class=None) -> list[tuple[int, str]]:
    """Collective (every rank calls it at the same point): ``error`` is this rank's failure of the phase
    (None: it succeeded), of ``error_class`` (the name the launcher gives it). Returns every failing rank's
    (rank, error), the same list on every rank; empty when all succeeded (one all-reduce of one integer)."""
    from smp_adapter.runtime.state import state

    if error:
        report_cause(f"{error_class.__name__}: {error}" if error_class is not None else error)
    if world_size == 1:
        return [(state.rank, error)] if error else []
    if not max_over_ranks([1 if error else 0], world_size)[0]:
        return []
    import torch.distributed as dist

    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, error, group=_objects_group(state))
    return [(rank, e) for rank, e in enumerate(everyone) if e]


def raise_agreed(failures: list[tuple[int, str]], error_class) -> None:
    """After ``agree_on_failure``: nothing when no rank failed; else this rank's own error, or, on a rank
    that did not fail, the first failing rank's, saying so."""
    if not failures:
        return
    from smp_adapter.runtime.state import state

    own = [e for rank, e in failures if rank == state.rank]
    if own:
        raise error_class(own[0])
    rank, error = failures[0]
    raise error_class(f"rank {rank} failed, so every rank stops here: {error}")
