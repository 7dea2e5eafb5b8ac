"""ParallelDims: an SMPConfig placed on a concrete world size.

Like torchtitan's ``ParallelDims``: the user-facing config stays separate from the validated
object that knows the degrees and owns the rank grid. Everything here is pure arithmetic:

    world = pp * tp * rdp          dp = tp * rdp          mp = pp * tp
    sdp divides rdp; sdp == rdp -> plain ZeRO-3; sdp < rdp -> ZeRO-3 + hpZ groups of sdp ranks
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_adapter.config.layout import RankGrid
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any


@dataclass(frozen=True)
class ParallelDims:
    cfg: SMPConfig
    world_size: int
    grid: RankGrid

    @classmethod
    def from_config(cls, cfg: SMPConfig, world_size: int) -> "ParallelDims":
        pp, tp, sdp = cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.sharded_data_parallel_degree
        problems: list[ConfigProblem] = []
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise_if_any([ConfigProblem("world_size", "must be a positive integer", "launch at least one process", world_size)])
        if world_size > MAX_WORLD_SIZE:
            raise_if_any([ConfigProblem("world_size", f"must be <= {MAX_WORLD_SIZE} (smp-adapter's limit, MAX_WORLD_SIZE)",
                                        "launch fewer processes", world_size)])
        if world_size % (pp * tp):
            problems.append(ConfigProblem(
                "pipeline_parallel_degree" if pp > 1 else "tensor_parallel_degree",
                f"pipeline_parallel_degree ({pp}) x tensor_parallel_degree ({tp}) = {pp * tp} does not divide "
                f"the number of processes ({world_size})",
                f"launch a multiple of {pp * tp} processes, or choose degrees whose product divides {world_size}",
                pp if pp > 1 else tp))
            raise_if_any(problems)
        rdp = world_size // (pp * tp)
        if rdp % sdp:
            problems.append(ConfigProblem(
                "sharded_data_parallel_degree",
                f"must divide the number of model replicas (rdp size = {world_size} processes / (pp {pp} x tp {tp}) = {rdp})",
                f"use a divisor of {rdp}, e.g. {rdp} (shard over all replicas)", sdp))
        if rdp > 1 and not cfg.ddp:
            problems.append(ConfigProblem(
                "ddp", f"must be true when there is more than one model replica ({rdp} replicas on {world_size} processes)",
                "add ddp: true", False))
        raise_if_any(problems)
        return cls(cfg, world_size, RankGrid.from_degrees(world_size, pp=pp, tp=tp, placement=cfg.placement_strategy))

    # -- degrees -------------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return self.grid.pp

    @property
    def tp(self) -> int:
        return self.grid.tp

    @property
    def rdp(self) -> int:
        return self.grid.rdp

    @property
    def dp(self) -> int:
        return self.grid.dp_size

    @property
    def sdp(self) -> int:
        return self.cfg.sharded_data_parallel_degree

    def stage_index_problem(self, index: int) -> str | None:
        """Why a manual partition mark ``index`` cannot be used, or None. Under auto_partition the
        marks are ignored (as smp v1 did), so any index >= 0 is fine and a pipeline script can be
        debugged at pipeline_parallel_degree 1 unchanged; otherwise it must name a stage."""
        if not self.cfg.auto_partition and index >= self.pp:
            return (f"the partition index must be between 0 and pipeline_parallel_degree - 1 = {self.pp - 1} "
                    "(auto_partition is false, so the marks place modules): use a smaller index or raise "
                    "pipeline_parallel_degree")
        return None

    # -- what the engines get ------------------------------------------------------------------
    @property
    def engine(self) -> str:
        """The engine that runs this layout (runtime/engines): the one branch on the pipeline degree.
        pp > 1: torch.distributed.pipelining stages ("pipeline"); pp = 1: DeepSpeed ZeRO 0/1/3 ("deepspeed")."""
        return "pipeline" if self.pp > 1 else "deepspeed"

    @property
    def zero_stage(self) -> int:
        if self.sdp > 1:
            return 3
        return 1 if self.cfg.shard_optimizer_state else 0

    @property
    def hpz_partition_size(self) -> int:
        """ZeRO++ hpZ secondary shard size: sdp when it is smaller than the rdp size, else 1 (off)."""
        return self.sdp if 1 < self.sdp < self.rdp else 1

    def describe_grid(self) -> str:
        """The rank grid (its product is the world size), as the layout line and explain's world-size row say it."""
        return f"pp {self.pp} x tp {self.tp} x rdp {self.rdp}"

    def describe(self) -> str:
        """The layout in one line, as `plan` and `translate --explain` print it."""
        return (f"{self.describe_grid()}, sdp {self.sdp}, ZeRO stage {self.zero_stage}"
                + (f", hpZ groups of {self.hpz_partition_size}" if self.hpz_partition_size > 1 else ""))

    def micro_batch_size(self, per_rank_batch: int) -> int:
        """Samples per microbatch: the per-rank batch fed to smp.step divided by microbatches."""
        mb = self.cfg.microbatches
        if per_rank_batch % mb:
            raise_if_any([ConfigProblem(
                "microbatches", f"must divide the per-rank batch size ({per_rank_batch})",
                f"use a batch size that is a multiple of {mb} (DataLoader(..., drop_last=True))", mb)])
        return per_rank_batch // mb

    def tp_region_batch(self, samples: int) -> int:
        """Samples a tensor-parallel layer computes on when each rank passes ``samples``
        (docs/translation.md §3, derived settings).

        prescaled_batch false: the TP group's batches are all-gathered on entry of the TP region
        ([B, S, H] -> [tp x B, S, H], each rank then holding 1/tp of the features) -> tp * samples.
        prescaled_batch true: the group shares one batch, the library only slices -> samples.
        """
        return samples if self.cfg.prescaled_batch else self.tp * samples

    def global_batch_size(self, per_rank_batch: int) -> int:
        """Samples per optimizer step over the whole job (docs/translation.md §3, derived settings).

        prescaled_batch false: every DP rank (tp x rdp) reads its own batch -> dp * batch.
        prescaled_batch true: all ranks of a TP group read the same batch -> rdp * batch.
        """
        replicas = self.rdp if self.cfg.prescaled_batch else self.dp
        return replicas * per_rank_batch
