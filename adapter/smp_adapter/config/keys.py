"""The policy table: every smp v1 ``modelparallel.parameters`` key and what smp-adapter does with it.

One row per key, and exactly one policy per row:

* ``translated`` - carried out by an engine setting: which DeepSpeed entries is
  ``translate/deepspeed.py``'s ``DEEPSPEED_KEYS`` (held there only), what it becomes on each engine is that
  engine's key table (translate/key_meanings.py), the note says what it does;
* ``alias``      - another name of a translated key (``alias_of``);
* ``ignored``    - accepted, with a one-time warning saying why nothing is done;
* ``rejected``   - a non-default value is an error that names the closest supported setting.

Each row's ``default`` is the key's one default: SMPConfig's fields take theirs from here.
The keys: smp v1's documented parameters and those seen in public scripts, plus the smp v2 keys users bring along
(docs/translation.md lists each with its policy).
Type rules (our choice, documented in docs/translation.md): bools must be JSON/YAML booleans;
ints accept integers and integral floats (``5e8``) but never bools or strings; floats accept
ints and floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from smp_adapter.config.limits import MAX_DEGREE

D = MAX_DEGREE  # upper bound of every degree and count (config/limits.py)


class Policy(str, Enum):
    TRANSLATED = "translated"
    ALIAS = "alias"
    IGNORED = "ignored"
    REJECTED = "rejected"


@dataclass(frozen=True)
class KeySpec:
    name: str
    kind: str  # "int", "bool", "float", "str"
    default: Any
    policy: Policy
    note: str  # translated: the engine setting; ignored: why; rejected: what to use instead
    choices: tuple | None = None
    alias_of: str | None = None
    minimum: float | None = None
    maximum: float | None = None


T, A, I, R = Policy.TRANSLATED, Policy.ALIAS, Policy.IGNORED, Policy.REJECTED

_ROWS = [
    # -- parallelism degrees and pipeline --------------------------------------------------
    KeySpec("pipeline_parallel_degree", "int", 1, T, "pipeline stages (torch.distributed.pipelining stages / Megatron pipeline_model_parallel_size)", minimum=1, maximum=D),
    KeySpec("partitions", "int", None, A, "pre-v1.6 name of pipeline_parallel_degree", alias_of="pipeline_parallel_degree", minimum=1, maximum=D),
    KeySpec("tensor_parallel_degree", "int", 1, T, "Megatron-core tensor_model_parallel_size", minimum=1, maximum=D),
    KeySpec("microbatches", "int", 1, T, "gradient accumulation inside one smp.step call (pp=1) or pipeline microbatches", minimum=1, maximum=D),
    KeySpec("pipeline", "str", "interleaved", T, "pipeline schedule: interleaved = 1F1B, simple = all forward then all backward; smp-adapter extensions: interleaved_1f1b, zero_bubble, zbv, dualpipev (config/pipeline_schedule.py)", choices=("interleaved", "simple", "_only_forward", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")),
    KeySpec("virtual_pipeline_degree", "int", None, T, "smp-adapter extension: pipeline stages per rank for pipeline: interleaved_1f1b (default 2) and zero_bubble (default 1); zbv / dualpipev use 2", minimum=1, maximum=D),
    KeySpec("active_microbatches", "int", None, T, "bound on microbatches in flight; default partitions + 2, clamped to microbatches", minimum=1, maximum=D),
    KeySpec("placement_strategy", "str", "cluster", T, "rank grid order (Megatron order string, DeepSpeed ProcessTopology axes)"),
    KeySpec("auto_partition", "bool", True, T, "automatic stage assignment by parameter bytes (False: smp.partition / default_partition)"),
    KeySpec("default_partition", "int", 0, T, "stage of modules outside any smp.partition context", minimum=0, maximum=D),
    KeySpec("optimize", "str", "memory", T, "sets the default memory_weight (speed: 0.2, memory: 0.8); Megatron TP layers always use the memory-saving split", choices=("memory", "speed")),
    KeySpec("memory_weight", "float", None, T, "weight of parameter bytes vs compute in the auto-partition objective", minimum=0.0, maximum=1.0),
    KeySpec("skip_tracing", "bool", False, I, "smp-adapter does not trace the model on a device; auto-partition uses parameter sizes"),
    KeySpec("deterministic_server", "bool", False, I, "there is no pipeline execution server: DeepSpeed schedules are already deterministic"),
    KeySpec("contiguous", "bool", True, I, "TensorFlow-only option; PyTorch stages are always contiguous layer ranges here"),
    KeySpec("horovod", "bool", False, R, "Horovod is TensorFlow-only in smp v1: set ddp: true for data parallelism"),
    # -- data parallelism ----------------------------------------------------------------------
    KeySpec("ddp", "bool", False, T, "data parallelism over the DP/RDP group (DeepSpeed data-parallel gradient reduction)"),
    KeySpec("ddp_port", "int", None, T, "rendezvous port (MASTER_PORT) when the launcher did not set one", minimum=0, maximum=65535),
    KeySpec("ddp_dist_backend", "str", "auto", T, "torch.distributed backend: auto = nccl on GPU, gloo on CPU", choices=("auto", "nccl", "gloo")),
    # -- memory saving -------------------------------------------------------------------------
    KeySpec("shard_optimizer_state", "bool", False, T, "optimizer-state sharding (ZeRO stage 1)"),
    KeySpec("offload_activations", "bool", False, T, "checkpointed activations kept on the CPU"),
    KeySpec("activation_loading_horizon", "int", 4, I, "DeepSpeed CPU activation checkpointing has no prefetch horizon; activations are loaded back when backward reaches them", minimum=1),
    KeySpec("delayed_parameter_initialization", "bool", False, T, "created without storage and recorded; materialised per stage/rank (ZeRO-3: module by module into shards)"),
    KeySpec("prescaled_batch", "bool", False, T, "tensor-parallel batch semantics (docs/translation.md)"),
    # -- mixed precision -----------------------------------------------------------------------
    KeySpec("fp16", "bool", False, T, "fp16 training (dynamic loss scale from DistributedOptimizer arguments)"),
    KeySpec("bf16", "bool", False, T, "bf16 training (allowed without sharded data parallel too)"),
    KeySpec("fp16_params", "bool", False, A, "v1.6-1.9 name for fp16 parameters: turns on fp16", alias_of="fp16"),
    # -- sharded data parallel -----------------------------------------------------------------
    KeySpec("sharded_data_parallel_degree", "int", 1, T, "ZeRO stage 3; hpZ groups of this size when smaller than the rdp size", minimum=1, maximum=D),
    KeySpec("sdp_reduce_bucket_size", "int", int(5e8), T, "gradient reduction bucket size (elements)", minimum=1),
    KeySpec("sdp_param_persistence_threshold", "int", int(1e6), T, "parameters with fewer elements stay whole on every rank", minimum=0),
    KeySpec("sdp_max_live_parameters", "int", int(1e9), T, "bound on gathered parameter elements at a time", minimum=1),
    KeySpec("sdp_hierarchical_allgather", "bool", True, I, "DeepSpeed gathers hierarchically through hpZ when sharded_data_parallel_degree < rdp size; there is no separate switch"),
    KeySpec("sdp_gradient_clipping", "float", 1.0, T, "gradient-norm clipping with sharded data parallel (0 turns it off)", minimum=0.0),
    # -- undocumented keys seen in AWS scripts / the SDK ---------------------------------------
    KeySpec("fast_mode", "bool", False, I, "undocumented smp switch passed by AWS examples; no engine equivalent"),
    KeySpec("static_mode", "bool", False, I, "undocumented smp switch passed by AWS examples; no engine equivalent"),
    KeySpec("overlapping_allreduce", "bool", True, I, "a DistributedModel argument the AWS BERT notebook passes as an option; "
            "gradients are reduced by the DeepSpeed engine (overlapped with backward on GPUs, after it on CPU) either way"),
    KeySpec("checkpoint_attentions", "bool", False, I, "undocumented switch of the AWS DLC GPT-2 test; call "
            "smp.set_activation_checkpointing on the attention modules to checkpoint them"),
    KeySpec("_match_weights", "bool", False, I, "undocumented test switch of the 2022 AWS GPT templates (TP weights "
            "equal to the unsplit model's); split weights are slices of the model's own weights here anyway"),
    KeySpec("_fp32_grad_accumulation", "bool", False, I, "undocumented switch of the 2022 AWS GPT templates: fp32 "
            "gradient buffers for their own apex-style fp16 optimizer, which smp-adapter does not run (use fp16: true)"),
    KeySpec("load_partition", "bool", False, I, "undocumented smp partition-file switch; stages are recomputed deterministically here"),
    KeySpec("partition_file", "str", None, I, "undocumented smp partition file; stages are recomputed deterministically here"),
    # -- SMP v2 (torch.sagemaker) keys: a different library -------------------------------------
    KeySpec("hybrid_shard_degree", "int", None, R, "SMP v2 key: in v1 scripts use sharded_data_parallel_degree"),
    KeySpec("sm_activation_offloading", "bool", None, R, "SMP v2 key: in v1 scripts use offload_activations"),
    KeySpec("fsdp_cache_flush_warnings", "bool", None, R, "SMP v2 (FSDP) key: remove it for v1 scripts"),
    KeySpec("allow_empty_shards", "bool", None, R, "SMP v2 (FSDP) key: remove it for v1 scripts"),
    KeySpec("context_parallel_degree", "int", None, R, "SMP v2 key: context parallelism is not part of smp v1; remove it"),
    KeySpec("expert_parallel_degree", "int", None, R, "SMP v2 key: expert parallelism is not part of smp v1; remove it"),
    KeySpec("random_seed", "int", None, R, "SMP v2 key: seed in the script (torch.manual_seed(seed + smp.dp_rank()))"),
]

KEYS: dict[str, KeySpec] = {row.name: row for row in _ROWS}

# smp v1's keys (documented or seen in public material). The table test checks
# that each has a row, so a key added to the spec cannot be silently forgotten.
DOCUMENTED_V1_KEYS = tuple(r.name for r in _ROWS if not r.note.startswith("SMP v2"))


def spec(name: str) -> KeySpec:
    return KEYS[name]
