"""What each smp key becomes, as data: one table per engine, and the rows every engine shares.

``translate --explain`` (translate/explain.py) reads a key's row from the table of the engine that runs
the layout (``ParallelDims.engine``): ``DEEPSPEED_ENGINE_KEYS`` here, ``PIPELINE_KEYS`` (translate/pipeline.py)
or ``MICS_KEYS`` (translate/mics.py); a key the engine's table does not name is an ignored or rejected key
(keys.py's policy and note) or means what ``EVERY_ENGINE_KEYS`` says. Which DeepSpeed entries a key decides
is ``DEEPSPEED_KEYS`` (translate/deepspeed.py), read here by name. docs/translation.md's table follows these
tables (tests/unit/test_translate.py), and the golden files hold the rows they give.

A row is a ``Meaning`` (its engine key and status fixed; its value and note fixed or computed from the
job) or, where the status too depends on the job's values, a small function ``(key, facts) -> (engine key,
engine value, status, note)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Union

from smp_adapter.config.dims import ENGINE_WORDS, SDP_ENGINE_ENV, ParallelDims
from smp_adapter.config.keys import KEYS
from smp_adapter.config.options import SMPConfig
from smp_adapter.translate.deepspeed import BUFFER_BOUND_WORDS, DEEPSPEED_KEYS, MAX_LIVE_WORDS, SDP_COPIED, deepspeed_value
from smp_adapter.translate.megatron import MegatronPlan


class Facts(NamedTuple):
    """What a row may read of the job: its options, layout, DeepSpeed config and Megatron plan."""

    cfg: SMPConfig
    dims: ParallelDims
    ds: Mapping[str, Any]
    mg: MegatronPlan


@dataclass(frozen=True)
class Meaning:
    engine_key: str
    status: str  # one of explain.STATUSES
    note: str | Callable[[Facts], str] = ""
    value: Callable[[Facts], Any] | None = None  # the engine value; None: the option's own value

    def explained(self, key: str, facts: Facts) -> tuple:
        value = getattr(facts.cfg, key) if self.value is None else self.value(facts)
        return self.engine_key, value, self.status, self.note(facts) if callable(self.note) else self.note


Row = Union[Meaning, Callable[[str, Facts], tuple]]


def explained(row: Row, key: str, facts: Facts) -> tuple:
    """(engine key, engine value, status, note) of ``key`` by its table row."""
    return row.explained(key, facts) if isinstance(row, Meaning) else row(key, facts)


def not_used(note: str) -> Meaning:
    """A key that has no effect on this engine (the note says why)."""
    return Meaning("-", "ignored", note, value=lambda f: "-")


def ds_entries(key: str, first: int | None = None) -> str:
    """'deepspeed <entries>' for an smp key, from the one mapping table (translate/deepspeed.py)."""
    return "deepspeed " + "; ".join(DEEPSPEED_KEYS[key][:first])


def _zero_stage(f: Facts) -> Any:
    return f.ds.get("zero_optimization", {}).get("stage")


def pp_degree(f: Facts) -> int:
    return f.dims.pp


NO_PIPELINE = "no pipeline with pipeline_parallel_degree 1"
PARTITIONS_ALIAS = "alias of pipeline_parallel_degree (pre-v1.6 name)"


def without_pipeline(engine: str) -> dict[str, Meaning]:
    """The pipeline keys on an engine that runs pp = 1 (deepspeed, mics): the whole model on every rank."""
    whole = f"no pipeline: the whole model on every rank, run by {ENGINE_WORDS[engine]}"
    degree = "megatron pipeline_model_parallel_size"
    return {
        "pipeline_parallel_degree": Meaning(degree, "exact", whole, value=pp_degree),
        "partitions": Meaning(degree, "exact", f"{PARTITIONS_ALIAS}; {whole}", value=pp_degree),
        "pipeline": not_used(NO_PIPELINE),
        "virtual_pipeline_degree": not_used("only with pipeline_parallel_degree > 1 and an smp-adapter pipeline schedule"),
        "auto_partition": not_used(NO_PIPELINE),
        "default_partition": not_used("only used with auto_partition: false and pipeline_parallel_degree > 1"),
        # memory_weight only weighs the pipeline's auto-partition: nothing else reads it
        **dict.fromkeys(("optimize", "memory_weight"), not_used(
            "no pipeline with pipeline_parallel_degree 1: it only weighs the automatic stage assignment, which does "
            "not happen here (tensor-parallel layers always use the memory-saving split)")),
    }


def microbatches_row(how: str) -> Meaning:
    return Meaning(f"{ds_entries('microbatches', 1)}; megatron num_microbatches", "exact", how,
                   value=lambda f: f.ds["gradient_accumulation_steps"])


def ddp_row(engine_words: str) -> Meaning:
    return Meaning(f"data-parallel gradient reduction ({engine_words})", "exact",
                   lambda f: f"over {f.dims.rdp} model replicas")


DEEPSPEED_ENGINE_KEYS: dict[str, Row] = {
    **without_pipeline("deepspeed"),
    "microbatches": microbatches_row("gradient accumulation inside one smp.step call"),
    "ddp": ddp_row("DeepSpeed engine"),
}


# -- rows whose status depends on the job's values --------------------------------------------------
def _placement(key: str, f: Facts) -> tuple:
    flag = f.mg.megatron_lm_order_flag()
    cli = ("Megatron-LM CLI: default order" if flag == "" else f"Megatron-LM CLI: {flag}" if flag
           else "no Megatron-LM CLI equivalent; pass order to initialize_model_parallel")
    return ("megatron order; deepspeed ProcessTopology axes",
            f"{f.mg.order}; {'-'.join(f.dims.grid.deepspeed_topology_axes())}", "exact", f"{f.cfg.placement_order}; {cli}")


def _backend(key: str, f: Facts) -> tuple:
    if f.cfg.ddp_dist_backend == "auto":
        return "torch.distributed backend", "nccl (GPU) / gloo (CPU)", "approximated", "no SMDDP collectives outside SageMaker"
    return "torch.distributed backend", f.cfg.ddp_dist_backend, "exact", ""


def _optimizer_sharding(f: Facts) -> str:
    if f.cfg.shard_optimizer_state:
        return "ZeRO-1: optimizer state sharded over the data-parallel ranks holding the same parameters"
    return "sharded data parallel shards optimizer state already" if f.dims.sdp > 1 else "optimizer state not sharded"


def _sharded_degree(key: str, f: Facts) -> tuple:
    dims = f.dims
    if dims.sdp == 1:
        return ds_entries(key, 1), _zero_stage(f), "exact", "sharded data parallel off"
    if dims.hpz_partition_size > 1:
        return f"{ds_entries(key, 1)} + zero_hpz_partition_size", f"3 + {dims.hpz_partition_size}", "approximated", \
            (f"MiCS groups of {dims.sdp} ranks approximated by ZeRO-3 + hpZ ({SDP_ENGINE_ENV}=hpz): parameters "
             f"gathered inside each group, optimizer state sharded over all {dims.rdp} replicas (less memory "
             "than MiCS); gradients reduce-scattered over all of them")
    return ds_entries(key, 1), 3, "exact", f"ZeRO-3 over all {dims.rdp} replicas"


# the words a default (not given) buffer key adds: what the runtime does with DeepSpeed's default
_DEFAULT_WORDS = {"sdp_reduce_bucket_size": BUFFER_BOUND_WORDS, "sdp_max_live_parameters": MAX_LIVE_WORDS}


def _sdp_entry(key: str, f: Facts) -> tuple:
    if f.dims.sdp == 1:
        return "-", "-", "ignored", "only used with sharded_data_parallel_degree > 1"
    note = _DEFAULT_WORDS.get(key, "") if key not in f.cfg.given else ""
    return ds_entries(key), deepspeed_value(f.ds, DEEPSPEED_KEYS[key][0]), "exact", note


def _delayed_init(key: str, f: Facts) -> tuple:
    return ("model creation", *delayed_init_effect(f.dims, f.cfg.delayed_parameter_initialization))


# sharded data parallel keys shown when sdp > 1: each decides one DeepSpeed entry (DEEPSPEED_KEYS)
SDP_KEYS = SDP_COPIED + ("sdp_gradient_clipping",)
LOSS_SCALE = "loss scale from DistributedOptimizer(static_loss_scale/dynamic_loss_scale)"

# What a key means whichever engine runs, where the engine's own table has no row for it.
EVERY_ENGINE_KEYS: dict[str, Row] = {
    "tensor_parallel_degree": Meaning("megatron tensor_model_parallel_size", "exact",
                                      "Megatron-core parallel layers for marked modules", value=lambda f: f.dims.tp),
    "active_microbatches": Meaning("microbatches in flight", "approximated", "default partitions + 2, clamped to "
                                   "microbatches; the 1F1B schedule also bounds it by the stage count"),
    "placement_strategy": _placement,
    "ddp_port": Meaning("launch --master_port / MASTER_PORT", "exact", "used when no master port is given to the launcher"),
    "ddp_dist_backend": _backend,
    "shard_optimizer_state": Meaning(f"{ds_entries('shard_optimizer_state')}; megatron use_distributed_optimizer",
                                     "exact", _optimizer_sharding, value=_zero_stage),
    "offload_activations": Meaning(ds_entries("offload_activations"), "approximated",
                                   "checkpointed activations go to CPU, but are copied back synchronously (no prefetch horizon)"),
    "delayed_parameter_initialization": _delayed_init,
    "prescaled_batch": Meaning("megatron global_batch_size", "exact", lambda f: "rdp x batch (TP group shares a batch)"
                               if f.cfg.prescaled_batch else "dp x batch (each TP rank reads its own batch)",
                               value=lambda f: f.mg.global_batch_size),
    "fp16": Meaning(f"{ds_entries('fp16')}; megatron fp16", "exact", LOSS_SCALE),
    "fp16_params": Meaning(f"{ds_entries('fp16')}; megatron fp16", "approximated", f"{KEYS['fp16_params'].note}; {LOSS_SCALE}"),
    "bf16": Meaning(f"{ds_entries('bf16')}; megatron bf16", "exact", lambda f: "smp v1 allowed bf16 only with sharded data "
                    "parallel; accepted without it here" if f.cfg.bf16 and f.dims.sdp == 1 else ""),
    "sharded_data_parallel_degree": _sharded_degree,
    **dict.fromkeys(SDP_KEYS, _sdp_entry),
}


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
