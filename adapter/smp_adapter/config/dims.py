"""ParallelDims: an SMPConfig placed on a concrete world size.

Like torchtitan's ``ParallelDims``: the user-facing config stays separate from the validated
object that knows the degrees and owns the rank grid. Everything here is pure arithmetic:

    world = pp * tp * rdp          dp = tp * rdp          mp = pp * tp
    sdp divides rdp; sdp == rdp -> plain ZeRO-3; 1 < sdp < rdp -> smp v1's MiCS (groups of sdp ranks
    sharding everything, replicated across groups) on FSDP2, or ZeRO-3 + hpZ where the adapter
    setting SMP_ADAPTER_SDP_ENGINE=hpz asks for it (``SDP_ENGINES``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from smp_adapter.config.layout import RankGrid
from smp_adapter.config.limits import MAX_WORLD_SIZE
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any


# The adapter setting (not an smp key) that says what runs 1 < sharded_data_parallel_degree < rdp:
# "mics" (default): smp v1's MiCS on torch FSDP2 hybrid sharding; "hpz": DeepSpeed ZeRO-3 + hpZ.
SDP_ENGINE_ENV = "SMP_ADAPTER_SDP_ENGINE"
SDP_ENGINES = ("mics", "hpz")


# What each engine (ParallelDims.engine) is, in the words the front doors (check, explain) use
ENGINE_WORDS = {"pipeline": "torch.distributed.pipelining stages (pipeline_parallel_degree > 1)",
                "mics": "smp v1's MiCS on torch FSDP2 (1 < sharded_data_parallel_degree < model replicas)",
                "deepspeed": "a DeepSpeed engine (ZeRO 0/1/3 or hpZ from the options)"}
ENGINE_RULE = (f"the layout picks the engine: {ENGINE_WORDS['pipeline']}; {ENGINE_WORDS['mics']}; otherwise "
               f"{ENGINE_WORDS['deepspeed']} (`smp-adapter translate OPTIONS --explain` names it)")


def per_microbatch(samples: int, microbatches: int) -> int | None:
    """Samples in each microbatch when ``samples`` split evenly into ``microbatches``, else None: the
    one rule behind translate's and plan's check of the per-rank batch and smp.step's split."""
    return None if samples % microbatches else samples // microbatches


def sdp_engine_from(environ: Mapping[str, str]) -> str:
    """The SMP_ADAPTER_SDP_ENGINE setting of ``environ`` ("mics" when unset); a bad value is refused."""
    value = environ.get(SDP_ENGINE_ENV, "").strip().lower() or "mics"
    if value not in SDP_ENGINES:
        raise_if_any([ConfigProblem(SDP_ENGINE_ENV, f"must be one of {', '.join(SDP_ENGINES)}",
                                    f"set {SDP_ENGINE_ENV}=mics (smp v1's MiCS, the default) or {SDP_ENGINE_ENV}=hpz "
                                    "(DeepSpeed ZeRO-3 + hpZ), or unset it", value)])
    return value


def with_layout_problems(error, world_size: int | None, sdp_engine: str = "mics"):
    """``error`` (an SMPConfigError of invalid options) with the problems ParallelDims also finds on
    ``world_size``, judged on the options whose values were valid (``error.partial``), so that one
    message lists every problem; a layout problem whose fix the options' problems already give is not
    repeated. Returns the error to raise."""
    from smp_adapter.errors import SMPConfigError

    if error.partial is None or world_size is None:
        return error
    try:
        ParallelDims.from_config(error.partial, world_size, sdp_engine)
    except SMPConfigError as layout:
        fixes = {p.fix for p in error.problems}
        extra = [p for p in layout.problems if p.fix not in fixes]
        if extra:
            return SMPConfigError([*error.problems, *extra])
    return error


@dataclass(frozen=True)
class ParallelDims:
    cfg: SMPConfig
    world_size: int
    grid: RankGrid
    sdp_engine: str = "mics"  # SDP_ENGINES: what runs 1 < sdp < rdp

    @classmethod
    def from_config(cls, cfg: SMPConfig, world_size: int, sdp_engine: str = "mics") -> "ParallelDims":
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
        if sdp_engine not in SDP_ENGINES:
            problems.append(ConfigProblem(SDP_ENGINE_ENV, f"must be one of {', '.join(SDP_ENGINES)}",
                                          f"set {SDP_ENGINE_ENV}=mics or hpz", sdp_engine))
        raise_if_any(problems)
        return cls(cfg, world_size, RankGrid.from_degrees(world_size, pp=pp, tp=tp, placement=cfg.placement_strategy),
                   sdp_engine)

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
        """The engine that runs this layout (runtime/engines), the one home of that choice.
        pp > 1: torch.distributed.pipelining stages ("pipeline"); pp = 1 and 1 < sdp < rdp: smp v1's
        MiCS on torch FSDP2 ("mics"), unless SMP_ADAPTER_SDP_ENGINE=hpz; otherwise DeepSpeed ZeRO 0/1/3
        (+ hpZ) ("deepspeed")."""
        if self.pp > 1:
            return "pipeline"
        return "mics" if self.chooses_sdp_engine and self.sdp_engine == "mics" else "deepspeed"

    @property
    def sdp_below_rdp(self) -> bool:
        """1 < sdp < rdp: groups of sdp ranks shard, each replicated rdp / sdp times (MiCS's groups, or
        hpZ's secondary partition), the one home of that test."""
        return 1 < self.sdp < self.rdp

    @property
    def chooses_sdp_engine(self) -> bool:
        """pp 1 and 1 < sdp < rdp: the layout SDP_ENGINE_ENV picks an engine for (mics, the default, or
        hpz). (from_config refuses sdp > 1 with pp > 1, as smp v1 did; the pp test keeps the rule whole.)"""
        return self.pp == 1 and self.sdp_below_rdp

    def sdp_engine_note(self) -> str | None:
        """Which engine runs sdp < rdp and how to pick the other (launch, smp.init and plan print it);
        None where the layout has no choice."""
        if not self.chooses_sdp_engine:
            return None
        head = f"sharded_data_parallel_degree {self.sdp} < rdp {self.rdp}: "
        if self.engine == "mics":
            return (head + f"smp v1's MiCS on torch FSDP2 (groups of {self.sdp} ranks shard everything); "
                    f"{SDP_ENGINE_ENV}=hpz runs DeepSpeed ZeRO-3 + hpZ instead")
        return head + f"DeepSpeed ZeRO-3 + hpZ ({SDP_ENGINE_ENV}=hpz); unset it for smp v1's MiCS on torch FSDP2"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the job's sharding: 3 for sharded data parallelism (MiCS shards
        parameters, gradients and optimizer state too, inside its groups)."""
        if self.sdp > 1:
            return 3
        return 1 if self.cfg.shard_optimizer_state else 0

    @property
    def mics_group_size(self) -> int:
        """MiCS: the ranks that shard everything among themselves (sdp), replicated rdp / sdp times; 1: off."""
        return self.sdp if self.engine == "mics" else 1

    @property
    def hpz_partition_size(self) -> int:
        """ZeRO++ hpZ secondary shard size: sdp when it is smaller than the rdp size and DeepSpeed
        runs it (SMP_ADAPTER_SDP_ENGINE=hpz, or pipeline parallelism), else 1 (off)."""
        return self.sdp if self.sdp_below_rdp and self.engine != "mics" else 1

    def describe_grid(self) -> str:
        """The rank grid (its product is the world size), as the layout line and explain's world-size row say it."""
        return f"pp {self.pp} x tp {self.tp} x rdp {self.rdp}"

    def describe(self) -> str:
        """The layout in one line, as `plan` and `translate --explain` print it."""
        if self.mics_group_size > 1:
            return (f"{self.describe_grid()}, sdp {self.sdp}, MiCS: groups of {self.sdp} shard everything, "
                    f"{self.rdp // self.sdp} replicas (torch FSDP2)")
        return (f"{self.describe_grid()}, sdp {self.sdp}, ZeRO stage {self.zero_stage}"
                + (f", hpZ groups of {self.hpz_partition_size}" if self.hpz_partition_size > 1 else ""))

    def micro_batch_size(self, per_rank_batch: int) -> int:
        """Samples per microbatch: the per-rank batch fed to smp.step divided by microbatches."""
        mb = self.cfg.microbatches
        size = per_microbatch(per_rank_batch, mb)
        if size is None:
            raise_if_any([ConfigProblem(
                "microbatches", f"must divide the per-rank batch size ({per_rank_batch})",
                f"use a batch size that is a multiple of {mb} (DataLoader(..., drop_last=True))", mb)])
        return size

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
