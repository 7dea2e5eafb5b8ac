"""Pipeline schedules: the values of the ``pipeline`` option and the rules each one imposes.

smp v1 knows two schedules, ``interleaved`` (one-forward-one-backward, torch's ``Schedule1F1B``)
and ``simple`` (all forwards, then all backwards: ``ScheduleGPipe``). smp-adapter adds four values
(extensions: an smp v1 script never names them), each a schedule of torch 2.13's pipelining:

=================== ===================================== =============== ================================
value               torch schedule                        stages per rank bubble (p ranks, m microbatches)
=================== ===================================== =============== ================================
interleaved_1f1b    ScheduleInterleaved1F1B               v >= 2          (p-1)(F+B) / v
zero_bubble         ScheduleInterleavedZeroBubble         v >= 1          (p-1)(F+B-2W) at v = 1 (ZB-H1)
zbv                 ScheduleZBVZeroBubble                 2, in a V       about (p-1)(F+B-2W) / 2
dualpipev           ScheduleDualPipeV                     2, in a V       about (p-1)(F+B-3W) / 2 (m >= 2p)
=================== ===================================== =============== ================================

(F, B: one stage's forward and whole backward of a microbatch; W: its weight-gradient part.)
``v`` is ``virtual_pipeline_degree``. The model is cut into p x v stages; with the looped order
(interleaved_1f1b, zero_bubble) rank r holds stages r, r+p, r+2p, ...; with the V order (zbv,
dualpipev) rank r holds stages r and 2p-1-r, so rank 0 holds the first and the last stage.

Every rule is checked here, at option validation, with one SMPConfigError naming the key and the
fix; the runtime (runtime/engines/pipeline) only picks the torch class.
"""

from __future__ import annotations

from typing import Any, Mapping

from smp_adapter.config.problems import ConfigProblem

SMP_V1_SCHEDULES = ("interleaved", "simple")
EXTENSION_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
# schedules whose backward is split into input-gradient and weight-gradient steps (torch's
# stage_backward_input / stage_backward_weight)
SPLIT_BACKWARD = ("zero_bubble", *V_SHAPED)
# virtual_pipeline_degree when not given
DEFAULT_VIRTUAL = {"interleaved": 1, "simple": 1, "_only_forward": 1, "interleaved_1f1b": 2, "zero_bubble": 1,
                   "zbv": 2, "dualpipev": 2}
TORCH_CLASS = {"interleaved": "Schedule1F1B", "simple": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B",
               "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}


def virtual_degree(values: Mapping[str, Any]) -> int:
    """Stages per pipeline rank for the (validated) option values."""
    return values.get("virtual_pipeline_degree") or DEFAULT_VIRTUAL[values.get("pipeline", "interleaved")]


def stage_ranks(pp: int, v: int, v_shaped: bool) -> list[int]:
    """Pipeline rank holding each of the pp x v stages: looped (stage s on rank s mod pp) or V."""
    if v_shaped:
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def stage_order(cfg, pp: int) -> list[int]:
    """The pipeline rank of each stage a job with these (validated) options cuts its model into."""
    if pp == 1:
        return [0]
    return stage_ranks(pp, cfg.virtual_pipeline_degree, cfg.pipeline in V_SHAPED)


def bubble_formula(schedule: str, pp: int, v: int) -> str:
    """The schedule's idle time per step, for reports next to measured idle fractions."""
    return {"interleaved": "(p-1)(F+B)", "simple": "(p-1)(F+B)", "interleaved_1f1b": "(p-1)(F+B)/v",
            "zero_bubble": "(p-1)(F+B-2W)" if v == 1 else "(p-1)(F+B-2W)/v", "zbv": "~(p-1)(F+B-2W)/2",
            "dualpipev": "~(p-1)(F+B-3W)/2"}.get(schedule, "?").replace("p", str(pp)).replace("v", str(v))


def schedule_problems(values: Mapping[str, Any], raw: Mapping[str, Any]) -> list[ConfigProblem]:
    """Every rule of the pipeline schedule options (values: coerced, aliases folded)."""
    problems: list[ConfigProblem] = []
    add = problems.append
    schedule = values.get("pipeline", "interleaved")
    pp, m = values.get("pipeline_parallel_degree", 1), values.get("microbatches", 1)
    given_v = values.get("virtual_pipeline_degree")
    if given_v is not None and schedule not in ("interleaved_1f1b", "zero_bubble", *V_SHAPED):
        add(ConfigProblem("virtual_pipeline_degree", f"only applies to pipeline: interleaved_1f1b or zero_bubble "
                          f"(stages per rank), not to pipeline: {schedule}",
                          "remove virtual_pipeline_degree, or set pipeline: interleaved_1f1b", given_v))
        return problems
    if schedule not in EXTENSION_SCHEDULES or pp == 1:
        return problems  # smp's own values; with pp = 1 there is no pipeline (the option is ignored, as smp's)
    v = virtual_degree(values)
    if schedule == "interleaved_1f1b" and v < 2:
        add(ConfigProblem("virtual_pipeline_degree", "must be >= 2 with pipeline: interleaved_1f1b (one stage per rank "
                          "is plain 1F1B)", "use virtual_pipeline_degree: 2, or pipeline: interleaved", v))
    if schedule in V_SHAPED and v != 2:
        add(ConfigProblem("virtual_pipeline_degree", f"must be 2 with pipeline: {schedule} (the V holds exactly two "
                          "stages per rank)", "remove virtual_pipeline_degree (it defaults to 2)", v))
    if v > 1 and values.get("auto_partition", True) is False:
        # smp.partition's index is the pipeline rank, and a rank's part of the model is one contiguous
        # run of modules; with several stages per rank a rank's stages are not contiguous (looped:
        # r, r+p, ...; V: r and 2p-1-r), so the marks cannot say where its stages are
        add(ConfigProblem("auto_partition", f"must be true with pipeline: {schedule} and virtual_pipeline_degree {v}: "
                          "smp.partition / set_partition name a pipeline rank, whose part of the model is contiguous, "
                          f"while this schedule gives each rank {v} stages that are not (rank r holds "
                          f"{'r and 2p-1-r' if schedule in V_SHAPED else 'r, r+p, ...'})",
                          "set auto_partition: true (marks are then ignored), or keep the marks with pipeline: "
                          "zero_bubble (one stage per rank) or interleaved", False))
    if m < pp:
        add(ConfigProblem("microbatches", f"must be >= pipeline_parallel_degree ({pp}) with pipeline: {schedule} "
                          f"(fewer microbatches than ranks never fill the pipeline)",
                          f"use microbatches >= {pp}, or pipeline: simple", m))
    elif schedule in ("interleaved_1f1b", "zero_bubble"):
        # torch's looped schedules run rounds of m // pp microbatches: m must split into whole rounds
        rounds = max(1, m // pp)
        if m % rounds:
            add(ConfigProblem("microbatches", f"must be a multiple of its number of rounds (microbatches // "
                              f"pipeline_parallel_degree = {rounds}) with pipeline: {schedule} (torch's looped "
                              f"schedule runs {rounds} equal rounds)",
                              f"use microbatches: {rounds * pp} or {(rounds + 1) * pp}", m))
    if schedule == "dualpipev" and m < 2 * pp:
        add(ConfigProblem("microbatches", f"must be >= 2 x pipeline_parallel_degree ({2 * pp}) with pipeline: "
                          "dualpipev (DualPipeV needs a microbatch for each of its 2p stages)",
                          f"use microbatches >= {2 * pp}, or pipeline: zbv", m))
    if "active_microbatches" in raw and values.get("active_microbatches", m) < m:
        add(ConfigProblem("active_microbatches", f"cannot bound pipeline: {schedule}: its torch schedule orders all "
                          "microbatches of a step itself and keeps at most about p x v in flight",
                          "remove active_microbatches (or set it to microbatches), or use pipeline: interleaved "
                          "to bound the microbatches in flight", values["active_microbatches"]))
    return problems
