"""Which layouts ``plan --search`` considers, and how each realises the job's global batch.

A layout is every choice that changes how the job runs but not what it computes: (pp, tp, sdp and
the engine that runs it, ZeRO-1, prescaled_batch, pipeline schedule) x activation checkpointing x the
microbatch size. 1 < sdp < rdp is planned twice: on MiCS (the default) and on DeepSpeed ZeRO-3 + hpZ
(the adapter setting SMP_ADAPTER_SDP_ENGINE=hpz), so the two rank side by side.
The config layer decides what is valid (ParallelDims, SMPConfig: nothing is re-implemented here);
on top of it plan drops what smp would refuse for this model or no practitioner would run: a
tensor-parallel degree that does not divide the attention (or key/value) heads, more pipeline
stages than layers, fewer microbatches than pipeline ranks, and tensor-parallel or hpZ groups
spanning nodes (kept with ``cross_node=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_adapter.config.dims import SDP_ENGINES, ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem
from smp_adapter.errors import SMPConfigError

# the pipeline schedules the search tries (config/pipeline_schedule.py): smp's 1F1B ("interleaved")
# and the ones with smaller bubbles; GPipe ("simple") keeps every microbatch in flight and is left out
SEARCHED_SCHEDULES = ("interleaved", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# the layout options the search sets; any other option the user gave (precision, sdp_* sizes, ...) is kept
SEARCHED_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree",
                 "shard_optimizer_state", "prescaled_batch", "pipeline", "virtual_pipeline_degree", "microbatches",
                 "active_microbatches", "ddp", "partitions", "fp16_params")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_heads(spec) -> int:
    return spec.kv_hidden * spec.heads // spec.hidden if spec.kv_hidden else spec.heads


def model_problems(spec, tp: int, pp: int = 1) -> list[ConfigProblem]:
    """The model's own limits on a layout: tensor parallelism splits the attention and key/value
    heads; a pipeline stage holds at least one layer."""
    out = []
    for what, count in (("attention heads", spec.heads), ("key/value heads", kv_heads(spec))):
        if count % tp:
            out.append(ConfigProblem("tensor_parallel_degree", f"must divide the model's {count} {what}",
                                     f"choose a tensor_parallel_degree that divides {count}", tp))
            break
    if pp > spec.layers:
        out.append(ConfigProblem("pipeline_parallel_degree", f"must not exceed the model's {spec.layers} layers (a "
                                 "stage holds at least one)", f"use at most {spec.layers} stages", pp))
    return out


def spans_nodes(ranks, gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def layout_problem(dims: ParallelDims, spec, gpus_per_node: int) -> str | None:
    """Why a valid layout is one no practitioner would run on this model and cluster, or None."""
    cfg = dims.cfg
    if dims.pp * cfg.virtual_pipeline_degree > spec.layers:
        return f"{dims.pp * cfg.virtual_pipeline_degree} pipeline stages for {spec.layers} layers"
    if dims.tp > 1 and spans_nodes(dims.grid.tp_group(0), gpus_per_node):
        return "tensor-parallel groups span nodes (every layer's exchanges cross the network)"
    if dims.hpz_partition_size > 1 and spans_nodes(dims.grid.sdp_groups(dims.sdp)[0], gpus_per_node):
        return "hpZ groups span nodes (the secondary copy's gathers cross the network)"
    return None


@dataclass(frozen=True)
class Sharding:
    sdp: int
    shard_optimizer_state: bool
    sdp_engine: str = "mics"  # ParallelDims.sdp_engine: what runs 1 < sdp < rdp (SDP_ENGINES)


def shardings(rdp: int, pp: int) -> list[Sharding]:
    """Plain data parallel (ZeRO-0), ZeRO-1, and sharded data parallel over every divisor of rdp:
    ZeRO-3 at rdp, below it MiCS and ZeRO-3 + hpZ, one each; sharded data parallel does not combine
    with pipelines (smp v1's rule)."""
    out = [Sharding(1, False)]
    if rdp > 1:
        out.append(Sharding(1, True))
        if pp == 1:
            for sdp in divisors(rdp):
                if sdp > 1:
                    out += [Sharding(sdp, False, engine) for engine in (SDP_ENGINES if sdp < rdp else ("mics",))]
    return out


def base_layouts(base: dict, world: int, spec, gpus_per_node: int, cross_node: bool = False):
    """(smp options, sdp engine) for every (pp, tp, sharding, prescaled_batch, schedule) the config
    layer accepts; microbatches are set per microbatch size (realisations)."""
    kept = {k: v for k, v in base.items() if k not in SEARCHED_KEYS}
    for pp in divisors(world):
        if pp > spec.layers:
            continue
        for tp in divisors(world // pp):
            if model_problems(spec, tp):
                continue
            rdp = world // (pp * tp)
            for sharding in shardings(rdp, pp):
                for prescaled in ((False, True) if tp > 1 else (False,)):
                    for schedule in (SEARCHED_SCHEDULES if pp > 1 else ("interleaved",)):
                        options = {**kept, "ddp": True, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                                   "sharded_data_parallel_degree": sharding.sdp, "prescaled_batch": prescaled,
                                   "shard_optimizer_state": sharding.shard_optimizer_state, "pipeline": schedule,
                                   # the extension schedules need m >= pp: checked per microbatch count below
                                   "microbatches": max(pp, 2 * pp if schedule == "dualpipev" else pp)}
                        try:
                            dims = ParallelDims.from_config(SMPConfig.from_dict(options), world, sharding.sdp_engine)
                        except SMPConfigError:
                            continue
                        problem = layout_problem(dims, spec, gpus_per_node)
                        if problem and not (cross_node and "span nodes" in problem):
                            continue
                        yield options, sharding.sdp_engine


def with_microbatches(options: dict, world: int, microbatches: int, sdp_engine: str = "mics") -> ParallelDims | None:
    """The layout with this microbatch count, or None when the config layer refuses it."""
    try:
        return ParallelDims.from_config(SMPConfig.from_dict({**options, "microbatches": microbatches}), world,
                                        sdp_engine)
    except SMPConfigError:
        return None


def realisations(options: dict, world: int, global_batch: int, sdp_engine: str = "mics"):
    """(dims, per-rank batch, accumulation) realising ``global_batch`` samples per optimizer step, one
    per microbatch size b dividing the samples of a replica: n = samples / b microbatches, as many as
    the schedule accepts in one smp.step call (m, the largest divisor of n it accepts, m >= pp), the
    rest as k = n / m calls per optimizer step (backward_passes_per_step)."""
    pp = options["pipeline_parallel_degree"]
    probe = with_microbatches(options, world, options["microbatches"], sdp_engine)
    if probe is None:
        return
    replicas = probe.global_batch_size(1)
    if global_batch % replicas:
        return
    samples = global_batch // replicas
    for b in divisors(samples):
        n = samples // b
        for m in sorted(divisors(n), reverse=True):
            if pp > 1 and m < pp:  # fewer microbatches than pipeline ranks never fill the pipeline
                break
            dims = probe if m == probe.cfg.microbatches else with_microbatches(options, world, m, sdp_engine)
            if dims is not None:
                yield dims, b * m, n // m
                break
