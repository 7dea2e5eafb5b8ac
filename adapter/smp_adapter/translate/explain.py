"""How each smp option was carried out: one row per option, as data and as a text table.

Status of a row:
  exact         the engine setting does what smp did
  approximated  the engine does something close; the note says how it differs
  ignored       accepted without effect; the note says why (the policy note from keys.py)
  default       the user did not give the key; its default is in effect and maps as shown
  refused       smp.init stops with an error naming what to use instead (an adapter setting this layout
                cannot run: SMP_ADAPTER_COMPILE=blocks with pipeline parallelism, say)
Rows come for every key the user gave, for the main keys left at their default, and for the
derived settings (world and rdp size, ZeRO stage, hpZ, batch arithmetic, gradient clipping).
What a key's row says is data: the key table of the engine that runs the layout, else the key's policy,
else the row every engine shares (translate/key_meanings.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from smp_adapter.config.dims import SDP_ENGINE_ENV, ParallelDims
from smp_adapter.config.distribution import JobSpec
from smp_adapter.config.keys import KEYS, Policy
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.pipeline_schedule import EXTENSION_SCHEDULES
from smp_adapter.translate.kernels import CompileSetting, explain_rows as kernel_rows
from smp_adapter.translate.key_meanings import DEEPSPEED_ENGINE_KEYS, EVERY_ENGINE_KEYS, SDP_KEYS, Facts, explained
from smp_adapter.translate.megatron import MegatronPlan
from smp_adapter.translate.mics import MICS_KEYS
from smp_adapter.translate.pipeline import PIPELINE_KEYS

STATUSES = ("exact", "approximated", "ignored", "default", "refused")
# Keys shown even when left at their default: they decide the layout and the engines.
CORE_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "microbatches", "placement_strategy", "ddp",
             "shard_optimizer_state", "sharded_data_parallel_degree", "prescaled_batch", "fp16", "bf16")


@dataclass(frozen=True)
class ExplainRow:
    key: str  # smp key, "mpi.<key>", or "(derived) <what>"
    value: Any  # as given, or the default / derived value
    source: str  # "given", "default" or "derived"
    engine_key: str
    engine_value: Any
    status: str  # one of STATUSES
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain(job_or_cfg: JobSpec | SMPConfig, dims: ParallelDims, ds_config: Mapping[str, Any],
            megatron_plan: MegatronPlan, compile_setting: CompileSetting = CompileSetting()) -> list[ExplainRow]:
    given = dict(job_or_cfg.options if isinstance(job_or_cfg, JobSpec) else job_or_cfg.given)
    cfg = dims.cfg
    facts = Facts(cfg, dims, ds_config, megatron_plan)
    rows: list[ExplainRow] = []
    shown = set()
    keys = list(given) + [k for k in CORE_KEYS if k not in given and not _alias_given(k, given)]
    if dims.sdp > 1:
        keys += [k for k in SDP_KEYS if k not in given]
    if dims.pp > 1:
        keys += [k for k in ("pipeline", "active_microbatches") if k not in given]
        if cfg.pipeline in EXTENSION_SCHEDULES:
            keys += [k for k in ("virtual_pipeline_degree",) if k not in given]
    for key in keys:
        if key in shown:
            continue
        shown.add(key)
        source = "given" if key in given else "default"
        value = given[key] if key in given else getattr(cfg, key)
        engine_key, engine_value, status, note = _map_key(key, facts)
        if source == "default" and status == "exact":
            status = "default"
        rows.append(ExplainRow(key, value, source, engine_key, engine_value, status, note))
    if isinstance(job_or_cfg, JobSpec):
        rows += _mpi_rows(job_or_cfg)
    rows += _derived_rows(dims, ds_config, megatron_plan)
    # the compile setting and what each kernel switch a script may use becomes (translate/kernels.py)
    rows += [ExplainRow(key, value, "derived", engine_key, engine_value, status, note)
             for key, value, engine_key, engine_value, status, note in kernel_rows(dims, compile_setting)]
    return rows


def _alias_given(key: str, given: Mapping[str, Any]) -> bool:
    return any(KEYS[k].alias_of == key for k in given if k in KEYS)


# each engine's key table (ParallelDims.engine names the engine that runs the layout, as smp.init chooses it)
ENGINE_KEYS = {"deepspeed": DEEPSPEED_ENGINE_KEYS, "mics": MICS_KEYS, "pipeline": PIPELINE_KEYS}


def _map_key(key: str, facts: Facts) -> tuple:
    """(engine key, engine value, status, note) for one smp key: the row of the engine's table, else the
    key's policy (keys.py: ignored, or rejected with its default), else the row every engine shares."""
    row = KEYS.get(key)
    own = ENGINE_KEYS[facts.dims.engine].get(key)
    if own is not None:
        return explained(own, key, facts)
    if row is not None and row.policy is Policy.IGNORED:
        return "-", "-", "ignored", row.note
    if row is not None and row.policy is Policy.REJECTED:  # only the default value gets this far
        return "-", "-", "ignored", f"default value accepted; {row.note}"
    if key in EVERY_ENGINE_KEYS:
        return explained(EVERY_ENGINE_KEYS[key], key, facts)
    return "-", "-", "ignored", row.note if row else "not an smp option"


def _mpi_rows(job: JobSpec) -> list[ExplainRow]:
    rows = []
    if job.source != "distribution":
        return rows
    rows.append(ExplainRow("instance_count", job.instance_count, "given", "--num_nodes / --nnodes / mpirun hosts",
                           job.instance_count, "exact", ""))
    if job.processes_per_host is not None:
        rows.append(ExplainRow("mpi.processes_per_host", job.processes_per_host, "given",
                               "--num_gpus / --nproc_per_node / mpirun host slots", job.processes_per_host, "exact", ""))
    if job.extra.get("instance_groups"):
        rows.append(ExplainRow("instance_groups", job.extra["instance_groups"], "given", "-", "-", "ignored",
                               "SageMaker heterogeneous clusters: the job runs on the hosts it is launched on "
                               "(--hostfile / --nnodes / mpirun hosts)"))
    if job.custom_mpi_options.strip():
        rows.append(ExplainRow("mpi.custom_mpi_options", job.custom_mpi_options, "given", "mpirun flags",
                               "appended", "approximated",
                               "appended to the mpirun line without repeating its MCA parameters; -x VAR=VALUE "
                               "also set for deepspeed/torchrun, other flags apply to mpirun only"))
    return rows


def _derived_rows(dims: ParallelDims, ds: Mapping[str, Any], mg: MegatronPlan) -> list[ExplainRow]:
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage")
    why = {0: "plain data parallel (ddp, no sharding)", 1: "shard_optimizer_state", 3: "sharded_data_parallel_degree > 1"}
    rows = [
        ExplainRow("(derived) world size", dims.world_size, "derived", "launch processes", dims.world_size, "exact",
                   dims.describe_grid()),
        ExplainRow("(derived) rdp size", dims.rdp, "derived", "megatron data_parallel_size", mg.data_parallel_size, "exact",
                   "model replicas = world / (pp x tp)"),
        ExplainRow("(derived) ZeRO stage", stage, "derived", "deepspeed zero_optimization.stage", stage, "exact", why.get(stage, ""))
        if dims.engine != "mics" else
        ExplainRow("(derived) ZeRO stage", stage, "derived", "MiCS engine (FSDP2 fully_shard)", "shard inside groups",
                   "exact", f"parameters, gradients and optimizer state sharded over groups of {dims.sdp} ranks"),
    ]
    if zero.get("zero_hpz_partition_size", 1) > 1:
        rows.append(ExplainRow("(derived) hpZ partition", dims.hpz_partition_size, "derived",
                               "deepspeed zero_optimization.zero_hpz_partition_size", zero["zero_hpz_partition_size"],
                               "approximated", f"stands in for MiCS (removed from DeepSpeed 0.19.7) because "
                                               f"{SDP_ENGINE_ENV}=hpz"))
    if dims.chooses_sdp_engine:
        rows.append(ExplainRow("(derived) sdp engine", dims.sdp_engine, "derived", f"{SDP_ENGINE_ENV}",
                               "runtime/engines/mics (torch FSDP2)" if dims.engine == "mics"
                               else "runtime/engines/deepspeed (ZeRO-3 + hpZ)", "exact",
                               f"what runs sharded_data_parallel_degree < rdp; {SDP_ENGINE_ENV}=mics (default) or hpz"))
    micro = ds["train_micro_batch_size_per_gpu"]
    rows += [
        ExplainRow("(derived) micro batch", micro, "derived", "MiCS engine: samples per microbatch"
                   if dims.engine == "mics" else "deepspeed train_micro_batch_size_per_gpu", micro, "exact",
                   f"per-rank batch {micro * dims.cfg.microbatches} / microbatches {dims.cfg.microbatches}"),
        ExplainRow("(derived) replica micro batch", mg.micro_batch_size, "derived", "megatron micro_batch_size",
                   mg.micro_batch_size, "exact", "samples per model replica per microbatch"),
        ExplainRow("(derived) global batch", mg.global_batch_size, "derived", "megatron global_batch_size", mg.global_batch_size,
                   "exact", ("rdp" if dims.cfg.prescaled_batch else "dp") + " x per-rank batch"),
        ExplainRow("(derived) gradient clipping", ds.get("gradient_clipping"), "derived",
                   "MiCS engine: clipped in optimizer.step()" if dims.engine == "mics" else "deepspeed gradient_clipping",
                   ds.get("gradient_clipping"), "exact",
                   "sdp_gradient_clipping" if dims.sdp > 1 else "smp clips only under sharded data parallel: 0.0 = off"),
    ]
    return rows


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def format_table(rows: list[ExplainRow]) -> str:
    """Plain aligned text; the note column is last and not padded."""
    header = ("smp key", "value", "source", "engine key", "engine value", "status", "note")
    cells = [header] + [(r.key, _cell(r.value), r.source, r.engine_key, _cell(r.engine_value), r.status, r.note) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    lines = []
    for n, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths)) + "  " + c[-1])
        if n == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(line.rstrip() for line in lines)
