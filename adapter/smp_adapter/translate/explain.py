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
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from smp_adapter.config.dims import ENGINE_WORDS, SDP_ENGINE_ENV, ParallelDims
from smp_adapter.config.distribution import JobSpec
from smp_adapter.config.keys import KEYS, Policy
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.pipeline_schedule import EXTENSION_SCHEDULES, TORCH_CLASS, V_SHAPED, bubble_formula
from smp_adapter.translate.deepspeed import BUFFER_BOUND_WORDS, DEEPSPEED_KEYS, MAX_LIVE_WORDS, SDP_COPIED, deepspeed_value
from smp_adapter.translate.kernels import CompileSetting, explain_rows as kernel_rows
from smp_adapter.translate.megatron import MegatronPlan
from smp_adapter.translate.mics import ENGINE as MICS_ENGINE, MICS_KEYS, layout_note as mics_layout_note

STATUSES = ("exact", "approximated", "ignored", "default", "refused")
# Keys shown even when left at their default: they decide the layout and the engines.
CORE_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "microbatches", "placement_strategy", "ddp",
             "shard_optimizer_state", "sharded_data_parallel_degree", "prescaled_batch", "fp16", "bf16")
# sharded data parallel keys shown when sdp > 1: each decides one DeepSpeed entry (DEEPSPEED_KEYS)
SDP_KEYS = SDP_COPIED + ("sdp_gradient_clipping",)


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
        engine_key, engine_value, status, note = _map_key(key, cfg, dims, ds_config, megatron_plan)
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


def _ds(key: str, first: int | None = None) -> str:
    """'deepspeed <entries>' for an smp key, from the one mapping table (translate/deepspeed.py)."""
    return "deepspeed " + "; ".join(DEEPSPEED_KEYS[key][:first])


def _map_key(key: str, cfg: SMPConfig, dims: ParallelDims, ds: Mapping[str, Any], mg: MegatronPlan) -> tuple:
    """(engine key, engine value, status, note) for one smp key."""
    row = KEYS.get(key)
    zero = ds.get("zero_optimization", {})
    if dims.mics_group_size > 1 and key in MICS_KEYS:  # what the MiCS engine makes of the key (translate/mics.py)
        engine_key, status, note = MICS_KEYS[key]
        return engine_key, "-" if key == "sdp_hierarchical_allgather" else getattr(cfg, key), status, note
    if row is not None and row.policy is Policy.IGNORED:
        return "-", "-", "ignored", row.note
    if row is not None and row.policy is Policy.REJECTED:  # only the default value gets this far
        return "-", "-", "ignored", f"default value accepted; {row.note}"
    if key in ("pipeline_parallel_degree", "partitions"):
        notes = ["alias of pipeline_parallel_degree (pre-v1.6 name)"] if key == "partitions" else []
        if dims.engine == "pipeline":  # the engine that runs the job (ParallelDims.engine), as smp.init chooses it
            notes.append("run by smp-adapter's pipeline engine on torch.distributed.pipelining, not by DeepSpeed's "
                         "PipelineEngine (the DeepSpeed config's pipeline.stages is for reference only)")
            return ("pipeline engine: torch.distributed.pipelining stages; megatron pipeline_model_parallel_size",
                    dims.pp, "exact", "; ".join(notes))
        # no pipeline: the DeepSpeed config has no pipeline section, so name the engine that runs the layout
        notes.append(f"no pipeline: the whole model on every rank, run by {ENGINE_WORDS[dims.engine]}")
        return "megatron pipeline_model_parallel_size", dims.pp, "exact", "; ".join(notes)
    if key == "tensor_parallel_degree":
        return "megatron tensor_model_parallel_size", dims.tp, "exact", "Megatron-core parallel layers for marked modules"
    if key == "microbatches":
        how = "pipeline microbatches" if dims.pp > 1 else "gradient accumulation inside one smp.step call"
        return f"{_ds(key, 1)}; megatron num_microbatches", ds["gradient_accumulation_steps"], "exact", how
    if key == "pipeline":
        if dims.pp == 1:
            return "-", "-", "ignored", "no pipeline with pipeline_parallel_degree 1"
        if cfg.pipeline in EXTENSION_SCHEDULES:
            v = cfg.virtual_pipeline_degree
            order = "V order (rank r: stages r, 2p-1-r)" if cfg.pipeline in V_SHAPED else "looped (rank r: r, r+p, ...)"
            return "pipeline schedule", f"torch {TORCH_CLASS[cfg.pipeline]}", "exact", \
                (f"smp-adapter extension (not in smp v1): {dims.pp * v} stages, {v} per rank, {order}; "
                 f"bubble {bubble_formula(cfg.pipeline, dims.pp, v)}")
        if cfg.pipeline == "simple":
            return "pipeline schedule", "all forward, then all backward", "approximated", \
                "GPipe-style order; the smp execution server's dynamic scheduling is not reproduced"
        return "pipeline schedule", "1F1B", "approximated", \
            "interleaved = backward first whenever possible, i.e. one-forward-one-backward; smp's dynamic order is not reproduced"
    if key == "virtual_pipeline_degree":
        if dims.pp == 1 or cfg.pipeline not in EXTENSION_SCHEDULES:
            return "-", "-", "ignored", "only with pipeline_parallel_degree > 1 and an smp-adapter pipeline schedule"
        return "pipeline stages per rank", cfg.virtual_pipeline_degree, "exact", \
            "smp-adapter extension (not in smp v1): the model is cut into pipeline_parallel_degree x this many stages"
    if key == "active_microbatches":
        return "microbatches in flight", cfg.active_microbatches, "approximated", \
            "default partitions + 2, clamped to microbatches; the 1F1B schedule also bounds it by the stage count"
    if key == "placement_strategy":
        flag = mg.megatron_lm_order_flag()
        cli = ("Megatron-LM CLI: default order" if flag == "" else f"Megatron-LM CLI: {flag}" if flag
               else "no Megatron-LM CLI equivalent; pass order to initialize_model_parallel")
        return "megatron order; deepspeed ProcessTopology axes", \
            f"{mg.order}; {'-'.join(dims.grid.deepspeed_topology_axes())}", "exact", f"{cfg.placement_order}; {cli}"
    if key == "auto_partition":
        if dims.pp == 1:
            return "-", "-", "ignored", "no pipeline with pipeline_parallel_degree 1"
        if cfg.auto_partition:
            return "stage assignment", "automatic", "approximated", \
                "balanced by parameter sizes weighted with memory_weight, not by traced execution time"
        return "stage assignment", "manual (smp.partition / set_partition)", "exact", ""
    if key == "default_partition":
        if dims.pp == 1 or cfg.auto_partition:
            return "-", "-", "ignored", "only used with auto_partition: false and pipeline_parallel_degree > 1"
        return "stage of unplaced modules", cfg.default_partition, "exact", ""
    if key in ("optimize", "memory_weight"):
        if dims.pp == 1:  # memory_weight only weighs the pipeline's auto-partition: nothing else reads it
            return "-", "-", "ignored", ("no pipeline with pipeline_parallel_degree 1: it only weighs the automatic "
                                         "stage assignment, which does not happen here (tensor-parallel layers always "
                                         "use the memory-saving split)")
        return "auto-partition memory_weight", cfg.memory_weight, "approximated", KEYS["optimize"].note if key == "optimize" else row.note
    if key == "ddp":
        how = {"mics": "MiCS engine, FSDP2", "pipeline": "pipeline engine"}.get(dims.engine, "DeepSpeed engine")
        over = (f"over {dims.rdp} data-parallel ranks ({dims.rdp // dims.sdp} MiCS replicas of {dims.sdp}-rank groups)"
                if dims.engine == "mics" else f"over {dims.rdp} model replicas")
        return f"data-parallel gradient reduction ({how})", cfg.ddp, "exact", over
    if key == "ddp_port":
        return "launch --master_port / MASTER_PORT", cfg.ddp_port, "exact", "used when no master port is given to the launcher"
    if key == "ddp_dist_backend":
        if cfg.ddp_dist_backend == "auto":
            return "torch.distributed backend", "nccl (GPU) / gloo (CPU)", "approximated", "no SMDDP collectives outside SageMaker"
        return "torch.distributed backend", cfg.ddp_dist_backend, "exact", ""
    if key == "shard_optimizer_state":
        note = ("ZeRO-1: optimizer state sharded over the data-parallel ranks holding the same parameters"
                if cfg.shard_optimizer_state else "sharded data parallel shards optimizer state already"
                if dims.sdp > 1 else "optimizer state not sharded")
        return f"{_ds(key)}; megatron use_distributed_optimizer", zero.get("stage"), "exact", note
    if key == "offload_activations":
        return _ds(key), cfg.offload_activations, "approximated", \
            "checkpointed activations go to CPU, but are copied back synchronously (no prefetch horizon)"
    if key == "delayed_parameter_initialization":
        return ("model creation", *delayed_init_effect(dims, cfg.delayed_parameter_initialization))
    if key == "prescaled_batch":
        return "megatron global_batch_size", mg.global_batch_size, "exact", \
            "rdp x batch (TP group shares a batch)" if cfg.prescaled_batch else "dp x batch (each TP rank reads its own batch)"
    if key in ("fp16", "fp16_params"):
        note = "loss scale from DistributedOptimizer(static_loss_scale/dynamic_loss_scale)"
        if key == "fp16_params":
            return f"{_ds('fp16')}; megatron fp16", cfg.fp16, "approximated", f"{row.note}; {note}"
        return f"{_ds('fp16')}; megatron fp16", cfg.fp16, "exact", note
    if key == "bf16":
        note = "smp v1 allowed bf16 only with sharded data parallel; accepted without it here" if cfg.bf16 and dims.sdp == 1 else ""
        return f"{_ds(key)}; megatron bf16", cfg.bf16, "exact", note
    if key == "sharded_data_parallel_degree":
        if dims.mics_group_size > 1:  # the engine smp.init chooses (ParallelDims.engine)
            return MICS_ENGINE, f"{dims.rdp // dims.sdp} x {dims.sdp}", "exact", mics_layout_note(dims)
        if dims.sdp == 1:
            return _ds(key, 1), zero.get("stage"), "exact", "sharded data parallel off"
        if dims.hpz_partition_size > 1:
            return f"{_ds(key, 1)} + zero_hpz_partition_size", f"3 + {dims.hpz_partition_size}", "approximated", \
                (f"MiCS groups of {dims.sdp} ranks approximated by ZeRO-3 + hpZ ({SDP_ENGINE_ENV}=hpz): parameters "
                 f"gathered inside each group, optimizer state sharded over all {dims.rdp} replicas (less memory "
                 "than MiCS); gradients reduce-scattered over all of them")
        return _ds(key, 1), 3, "exact", f"ZeRO-3 over all {dims.rdp} replicas"
    if key in SDP_KEYS:
        if dims.sdp == 1:
            return "-", "-", "ignored", "only used with sharded_data_parallel_degree > 1"
        notes = {"sdp_reduce_bucket_size": BUFFER_BOUND_WORDS if key not in cfg.given else "",
                 "sdp_max_live_parameters": MAX_LIVE_WORDS if key not in cfg.given else ""}
        return _ds(key), deepspeed_value(ds, DEEPSPEED_KEYS[key][0]), "exact", notes.get(key, "")
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


def delayed_init_effect(dims: ParallelDims, enabled: bool) -> tuple[str, str, str]:
    """(engine value, status, note) of delayed parameter initialisation on this layout: what the
    runtime does (runtime/engines: the engine's module_init_context and materialize_kept)."""
    if not enabled:
        return "off", "exact", ("parameters are created as the script creates them (smp.delay_param_initialization() "
                                "in the script still delays what it wraps)")
    values = "with the values the script's own creation gives (the same seed, the same weights on any layout)"
    if dims.engine == "deepspeed" and dims.zero_stage == 3:
        return "recorded; materialised module by module into ZeRO-3 shards", "exact", \
            ("parameters are created without storage; when DistributedModel wraps the model each rank replays one "
             f"module's creation at a time, {values}, and partitions it over the sharded data-parallel group at once: "
             "a rank holds its shards plus one module's whole tensors, never the whole model")
    if dims.engine == "mics":
        return "recorded; materialised tensor by tensor into FSDP2 shards", "exact", \
            ("parameters are created without storage; when DistributedModel wraps the model each sharding unit is "
             f"sharded in turn and each rank replays one tensor's creation at a time into its shard, {values}: a "
             "rank holds its shards plus one whole tensor, never the whole model")
    if dims.pp > 1:
        return "recorded; each stage materialised on its rank", "exact", \
            ("parameters are created without storage; when the first step has cut the stages each pipeline rank replays "
             f"the creation of its own stage(s) only, on its device, {values}: no rank ever holds the whole model")
    split = (", after the tensor-parallel split: each rank replays only its slices, one tensor's source at a time"
             if dims.tp > 1 else "")
    return "recorded; materialised by DistributedModel", "exact", \
        (f"parameters are created without storage and materialised on each rank's device when DistributedModel wraps "
         f"the model{split}, {values}; every rank keeps its whole (split) model, so this saves the host copy only")
