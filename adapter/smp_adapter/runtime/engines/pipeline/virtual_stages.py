"""Which pipeline stages a rank holds, with one or several (virtual) stages per rank.

smp v1 has one stage per pipeline rank. The schedules past 1F1B (config/pipeline_schedule.py) cut
the model into pp x v stages, v = virtual_pipeline_degree: the looped order gives rank r the stages
r, r+pp, r+2pp, ...; the V order (zbv, dualpipev) gives rank r the stages r and 2pp-1-r, so the
first and the last stage both live on rank 0. Everything rank-level in the runner (which rank
captures the model inputs, which runs the step body, which ranks share a tied parameter) is asked
of this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_adapter.config.pipeline_schedule import V_SHAPED, stage_ranks


@dataclass(frozen=True)
class StageLayout:
    pp: int  # pipeline ranks
    v: int  # stages per rank
    v_shaped: bool

    @classmethod
    def from_config(cls, cfg, pp: int) -> "StageLayout":
        return cls(pp, cfg.virtual_pipeline_degree if pp > 1 else 1, cfg.pipeline in V_SHAPED)

    @property
    def total(self) -> int:
        return self.pp * self.v

    @property
    def ranks(self) -> list[int]:
        """Pipeline rank of each stage."""
        return stage_ranks(self.pp, self.v, self.v_shaped)

    def stages_of(self, rank: int) -> list[int]:
        """The stages a rank holds, in stage order."""
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def rank_of(self, stage: int) -> int:
        return self.ranks[stage]

    @property
    def last_rank(self) -> int:
        """The rank holding the last stage (it runs the step body): pp-1, or 0 in the V order."""
        return self.ranks[-1]

    def ranks_of(self, stages) -> tuple[int, ...]:
        """The ranks holding any of these stages (a tied parameter's holders)."""
        return tuple(sorted({self.ranks[s] for s in stages}))

    def describe(self, stage: int) -> str:
        return str(stage) if self.v == 1 else f"{stage} (rank {self.ranks[stage]})"


def skip_self_warmup(stage) -> None:
    """In the V order the middle two stages live on one rank (stages pp-1 and pp). torch's schedules
    hand activations between them in memory, but the stage's p2p warm-up still sends a dummy
    tensor to its neighbours' ranks, here to its own, which gloo cannot do ("Pair is not
    connected"). Drop the warm-up ops whose peer is this rank."""
    own = stage.group_rank
    original = stage._get_init_p2p_neighbors_ops

    def ops():
        return [op for op in original() if op.group_peer != own]

    stage._get_init_p2p_neighbors_ops = ops

