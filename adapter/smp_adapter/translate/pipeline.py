"""What each smp key becomes on the pipeline engine (runtime/engines/pipeline: torch.distributed.pipelining,
pp > 1), for ``translate --explain``: the engine's key table (translate/key_meanings.py says how the tables
are read). The schedules' rules live in config/pipeline_schedule.py."""

from __future__ import annotations

from smp_adapter.config.keys import KEYS
from smp_adapter.config.pipeline_schedule import EXTENSION_SCHEDULES, TORCH_CLASS, V_SHAPED, bubble_formula
from smp_adapter.translate.key_meanings import PARTITIONS_ALIAS, Facts, Meaning, Row, ddp_row, microbatches_row, pp_degree

STAGES = "pipeline engine: torch.distributed.pipelining stages; megatron pipeline_model_parallel_size"
NOT_DEEPSPEED = ("run by smp-adapter's pipeline engine on torch.distributed.pipelining, not by DeepSpeed's "
                 "PipelineEngine (the DeepSpeed config's pipeline.stages is for reference only)")


def _schedule(key: str, f: Facts) -> tuple:
    cfg, pp = f.cfg, f.dims.pp
    if cfg.pipeline in EXTENSION_SCHEDULES:
        v = cfg.virtual_pipeline_degree
        order = "V order (rank r: stages r, 2p-1-r)" if cfg.pipeline in V_SHAPED else "looped (rank r: r, r+p, ...)"
        return "pipeline schedule", f"torch {TORCH_CLASS[cfg.pipeline]}", "exact", \
            (f"smp-adapter extension (not in smp v1): {pp * v} stages, {v} per rank, {order}; "
             f"bubble {bubble_formula(cfg.pipeline, pp, v)}")
    if cfg.pipeline == "simple":
        return "pipeline schedule", "all forward, then all backward", "approximated", \
            "GPipe-style order; the smp execution server's dynamic scheduling is not reproduced"
    return "pipeline schedule", "1F1B", "approximated", \
        "interleaved = backward first whenever possible, i.e. one-forward-one-backward; smp's dynamic order is not reproduced"


def _stages_per_rank(key: str, f: Facts) -> tuple:
    if f.cfg.pipeline not in EXTENSION_SCHEDULES:
        return "-", "-", "ignored", "only with pipeline_parallel_degree > 1 and an smp-adapter pipeline schedule"
    return "pipeline stages per rank", f.cfg.virtual_pipeline_degree, "exact", \
        "smp-adapter extension (not in smp v1): the model is cut into pipeline_parallel_degree x this many stages"


def _assignment(key: str, f: Facts) -> tuple:
    if f.cfg.auto_partition:
        return "stage assignment", "automatic", "approximated", \
            "balanced by parameter sizes weighted with memory_weight, not by traced execution time"
    return "stage assignment", "manual (smp.partition / set_partition)", "exact", ""


def _unplaced_stage(key: str, f: Facts) -> tuple:
    if f.cfg.auto_partition:
        return "-", "-", "ignored", "only used with auto_partition: false and pipeline_parallel_degree > 1"
    return "stage of unplaced modules", f.cfg.default_partition, "exact", ""


def _weight(f: Facts) -> float:
    return f.cfg.memory_weight


PIPELINE_KEYS: dict[str, Row] = {
    "pipeline_parallel_degree": Meaning(STAGES, "exact", NOT_DEEPSPEED, value=pp_degree),
    "partitions": Meaning(STAGES, "exact", f"{PARTITIONS_ALIAS}; {NOT_DEEPSPEED}", value=pp_degree),
    "microbatches": microbatches_row("pipeline microbatches"),
    "pipeline": _schedule,
    "virtual_pipeline_degree": _stages_per_rank,
    "auto_partition": _assignment,
    "default_partition": _unplaced_stage,
    "optimize": Meaning("auto-partition memory_weight", "approximated", KEYS["optimize"].note, value=_weight),
    "memory_weight": Meaning("auto-partition memory_weight", "approximated", KEYS["memory_weight"].note, value=_weight),
    "ddp": ddp_row("pipeline engine"),
}
