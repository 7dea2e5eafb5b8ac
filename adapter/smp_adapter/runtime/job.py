"""The job ``smp.init`` describes, frozen: what every engine is built from (runtime/engines).

An engine is handed this object (and the live ``StepProgress``, runtime/state.py) when smp.init
creates it, instead of reading the process-wide ``state``: an engine can then be built and tested
from a job description alone, and what it depends on is named in its constructor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """One smp job as this rank sees it: the options, their layout on the world, this rank's place,
    its torch process groups (``ProcessGroups``, built by smp.init) and the engine's one config."""

    cfg: Any  # SMPConfig: the effective options
    dims: Any  # ParallelDims: the options placed on the world
    groups: Any  # ProcessGroups: this rank's group of every smp kind
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    device: Any  # torch.device of this rank
    backend: str
    engine_config: Any = None  # the engine's one config for the job (DeepSpeed's dict), or None

    @property
    def coord(self):
        """This rank's coordinates on the rank grid (tp, pp, rdp, dp ...)."""
        return self.dims.grid.coord(self.rank)
