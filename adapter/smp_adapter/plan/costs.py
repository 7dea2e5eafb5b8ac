"""The cost formulas of ``smp-adapter plan``, written once: memory of the largest rank (device, and
the host memory model creation needs), bytes per optimizer step per group (the communication
ledger's quantity: payload as the caller passes it), and the predicted step time (plan/timing.py).
Pure arithmetic over a ModelSpec, a ParallelDims and a Cluster.

Notation (per rank): B = batch per data-parallel rank (per smp.step call), m = microbatches,
b = B / m samples per microbatch, k = smp.step calls per optimizer step (DistributedModel's
backward_passes_per_step), s = sequence length, h = hidden size, f = intermediate size, L = layers,
a = activation bytes per element (4 fp32, 2 fp16/bf16), t = tp, p = pp, v = stages per pipeline rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from smp_adapter.config.pipeline_schedule import V_SHAPED
from smp_adapter.plan import timing, zero3
from smp_adapter.plan.instances import Cluster
from smp_adapter.plan.mics_units import mics_units

CUDA_CONTEXT_BYTES = 600 * 2**20  # CUDA context + cuBLAS/NCCL workspaces, measured order on A100/T4 (stated)
FRAGMENTATION = 0.10  # caching allocator slack on top of live tensors (stated allowance)
# DeepSpeed's gradient buffers (elements), defaults the translation leaves alone: the engine's flat
# all-reduce buffer of plain data parallelism (engine.MEMORY_OPT_ALLREDUCE_SIZE) and ZeRO-1's
# reduce bucket (zero_optimization.reduce_bucket_size); ZeRO-3's is sdp_reduce_bucket_size
ZERO0_ALLREDUCE_BUFFER = 500_000_000
ZERO1_REDUCE_BUCKET = 500_000_000
# MiCS: the group of the ranks that hold the same shard, one in each sdp group (FSDP2's mesh dimension
# "replicate", rdp / sdp ranks), across which gradient shards are all-reduced
REPLICATE_GROUP = "replicate"


def zero3_buffers(cfg, tensors: list[int]) -> dict[str, int]:
    """The ZeRO-3 buffers the runtime gives DeepSpeed for a rank holding ``tensors`` (element counts):
    translate/deepspeed.zero3_buffer_sizes, bounded by the largest of them."""
    from smp_adapter.translate.deepspeed import zero3_buffer_sizes

    return zero3_buffer_sizes(cfg, max(tensors, default=0))


def zero3_gathers(spec, dims, job, tensors: list[int]) -> zero3.Gathers:
    """What DeepSpeed's coordinator gathers in one optimizer step (plan/zero3.py), with the job's buffers."""
    return zero3.gathers(spec, dims, job, zero3_buffers(dims.cfg, tensors), lambda n: persistent(n, dims.cfg))


@dataclass(frozen=True)
class Job:
    batch: int  # per data-parallel rank, per smp.step call
    activation_checkpointing: bool = False
    optimizer: str = "adam"  # adam | sgd
    accumulation: int = 1  # smp.step calls per optimizer step (backward_passes_per_step)
    delayed_init: bool = False  # the script creates the model under smp.delay_param_initialization()


@dataclass
class CommTerm:
    group: str  # smp group kind (rdp, sdp, tp, pp, ...)
    op: str  # all_reduce, all_gather, reduce_scatter, send, recv, broadcast
    bytes: float  # per step, as passed by the caller
    calls: float
    size: int  # ranks in the group (2 for p2p)
    intra_node: bool
    stride: int = 1  # rank distance between neighbours in the group
    overlap: str = timing.EXPOSED  # the compute phase it can hide behind (timing.PHASES), or none


@dataclass
class Plan:
    memory: dict = field(default_factory=dict)  # name -> bytes (largest rank)
    comm: list = field(default_factory=list)  # CommTerm per (group, op), per optimizer step
    compute_s: float = 0.0
    comm_s: float = 0.0  # every collective's time, overlapped or not
    exposed_comm_s: float = 0.0  # the part compute does not hide
    bubble_s: float = 0.0  # the pipeline schedule's idle time
    overhead_s: float = 0.0  # the pipeline's fixed cost per action (timing.PIPELINE_ACTION_S)
    passes: int = 3  # forward-equivalents of compute per microbatch (4 with recompute)
    microbatches: int = 1  # per optimizer step (m x k)
    samples: int = 0  # global batch of one optimizer step
    tokens: int = 0  # samples x sequence length
    world: int = 1
    model_flops: float = 0.0  # the model's training FLOPs per optimizer step (timing.model_flops_per_token)
    peak_flops: float = 0.0  # per GPU, at the job's precision
    efficiency: float = 0.0  # compute efficiency used (timing.COMPUTE_EFFICIENCY)
    efficiency_calibrated: bool = False
    host: dict = field(default_factory=dict)  # per-rank host bytes at model creation, with and without delayed init

    # bytes of the breakdown never alive together: ZeRO-0's all-reduce buffer is made after backward
    # has freed the activations (peak = breakdown total - overlap)
    overlap: int = 0

    @property
    def tensor_bytes(self) -> int:
        """The peak of live tensors (no CUDA context, no allocator slack): what the CPU runs measure."""
        return sum(v for k, v in self.memory.items() if k not in ("cuda_context", "fragmentation")) - self.overlap

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory.values()) - self.overlap

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s + self.overhead_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_time_s if self.step_time_s else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_time_s / self.world if self.step_time_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs per second over the GPUs' peak (PaLM's definition)."""
        return self.model_flops / (self.step_time_s * self.world * self.peak_flops) if self.step_time_s else 0.0


def element_bytes(cfg) -> int:
    return 2 if (cfg.fp16 or cfg.bf16) else 4


def precision(cfg) -> str:
    return "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32"


# -- parameters per rank ----------------------------------------------------------------------
def stage_layers(spec, pp: int) -> int:
    return math.ceil(spec.layers / pp)


def pipeline_stage_tensors(spec, dims) -> list[int]:
    """numel of each parameter tensor of the largest pipeline stage, as one rank materialises and
    keeps it (tensor-parallel tensors divided by t). With pp > 1 each rank holds only its own stage
    (issue 40: the other stages are never materialised under delayed parameter initialisation and
    freed after partitioning without it): ceil(L / pp) layers, plus every tensor outside the layers
    (embeddings, final norm, head), which the partitioner spreads over the first and last stages and
    plan counts on one: the largest stage, or a little more. pp = 1: the whole model."""
    t = dims.tp
    per_layer = [n // t if split and t > 1 else n for n, split in spec.layer_tensors]
    outer = [n // t if split and t > 1 else n for n, split in spec.outer_tensors]
    return per_layer * stage_layers(spec, dims.pp) + outer


def persistent(numel: int, cfg) -> bool:
    """ZeRO-3 keeps parameters below sdp_param_persistence_threshold elements whole on every rank."""
    return numel < cfg.sdp_param_persistence_threshold


# -- activations ----------------------------------------------------------------------------------
def layer_activation_bytes(spec, b: int, r: int, t: int, a: int) -> int:
    """Tensors one transformer layer keeps for backward, per microbatch (scaled-dot-product attention:
    the kernel keeps its output and log-sum-exp, not the s x s scores), counted from the autograd
    graph of Hugging Face's layers (the CPU runs measure it: docs/plan.md). b = the rank's samples,
    r = the samples a tensor-parallel unit computes on (ParallelDims.tp_region_batch: t x b when
    smp gathers the TP group's batch, b when prescaled or t = 1), each tensor inside a unit holding
    1/t of its features:
      own batch: the layer input and LayerNorm 2's input: 2 bsh
      each unit's (attention, MLP) input as its first matrix keeps it: 2 rsh (LayerNorm 1 and 2's
      outputs when r = b; the TP group's gathered batch otherwise, the rank's own copy then unsaved)
      attention: q k v (h + 2 kv), its output, heads merged for the output projection: (3h + 2kv) rs/t
      MLP: spec.mlp_saved tensors of rsf/t (2 for GELU, 4 for a gated SiLU, 5 for GPT-2's gelu_new,
      a tanh formula of Python operators each keeping an input)
      per LayerNorm its mean and rstd, b x s fp32 each; log-sum-exp: r x heads/t x s fp32."""
    s, h, f = spec.seq_len, spec.hidden, spec.intermediate
    kv = spec.kv_hidden or h
    return (a * s * (2 * b * h + 2 * r * h + r * ((3 * h + 2 * kv) + spec.mlp_saved * f) // t)
            + 4 * r * spec.heads // t * s + 2 * 2 * 4 * b * s)


def head_activation_bytes(spec, b: int, r: int, a: int) -> int:
    """The final LayerNorm's input, the head's input (the TP group's gathered batch, r samples, when
    the head is vocabulary-parallel without prescaled_batch), then a token head's logits, the shifted
    copy the causal-LM loss takes and its fp32 log-probabilities, or a classifier's logits. smp's
    vocabulary-parallel head hands every rank the whole vocabulary of its own samples (all_to_all,
    or a gather when prescaled), so the logits are b x s x V on every TP rank."""
    norm = a * (b + r) * spec.seq_len * spec.hidden
    if spec.vocab:
        return norm + b * spec.seq_len * spec.vocab * (2 * a + 4)
    return norm + b * (spec.num_labels or 2) * (a + 4)


# Activations the split-backward and looped schedules hold beyond 1F1B's, on their most loaded rank:
# measured (held activations per rank, saved-tensor hooks, pp 2, benchmarks/pipeline.py, RESULTS.md
# §11.1: 1F1B 60.3 MiB; zero_bubble 110.4, zbv 88.3, interleaved_1f1b 64.8, dualpipev 81.0). A
# deferred weight-gradient pass keeps its layer's inputs until it runs.
SCHEDULE_ACTIVATION_FACTOR = {"zero_bubble": 1.83, "zbv": 1.47, "interleaved_1f1b": 1.08, "dualpipev": 1.34}


def in_flight_microbatches(dims, stage: int = 0) -> float:
    """Microbatches' worth of a whole rank's layer activations pipeline rank ``stage`` holds at once.
    simple (GPipe): all m, in groups of active_microbatches (smp's default p + 2); interleaved (1F1B):
    min(m, p - stage), stage i running p - i forwards before its first backward; the other schedules:
    1F1B's times the factor measured for them (SCHEDULE_ACTIVATION_FACTOR)."""
    cfg, p = dims.cfg, dims.pp
    m = cfg.microbatches
    if p == 1:
        return 1  # microbatches run one after another, each backward before the next forward
    if cfg.pipeline == "simple":
        return min(m, max(1, cfg.active_microbatches))
    return min(m, p - stage) * SCHEDULE_ACTIVATION_FACTOR.get(cfg.pipeline, 1.0)


def host_bytes(spec, dims, tensors: list[int], delayed: bool) -> int:
    """Host memory one rank needs while the model is created (fp32, as PyTorch builds modules).
    Without delayed parameter initialisation every rank builds the whole model on the host before
    partitioning. With it nothing is materialised before partitioning: a pipeline rank materialises
    its own stage (counted on the host, as the brief of issue 40 bounds it) and every rank at least
    the largest single parameter it initialises."""
    largest = max([n for n, _ in spec.layer_tensors] + [n for n, _ in spec.outer_tensors] or [0])
    if not delayed:
        return 4 * spec.total_params
    return 4 * ((sum(tensors) if dims.pp > 1 else 0) + largest)


# -- the plan ---------------------------------------------------------------------------------------
def plan(spec, dims, cluster: Cluster, job: Job) -> Plan:
    out = Plan()
    tensors = pipeline_stage_tensors(spec, dims)
    model_state_memory(out.memory, dims, cluster, job, spec, tensors)
    out.memory["activations"] = activation_memory(spec, dims, job)
    if dims.zero_stage == 0:
        out.overlap = min(out.memory["activations"], out.memory.get("gradient_buckets", 0))
    out.memory["cuda_context"] = CUDA_CONTEXT_BYTES if not cluster.cpu_ranks else 0
    out.memory["fragmentation"] = int(FRAGMENTATION * out.tensor_bytes)
    out.host = {"without_delayed_init": host_bytes(spec, dims, tensors, False),
                "with_delayed_init": host_bytes(spec, dims, tensors, True),
                "delayed_init": bool(job.delayed_init or dims.cfg.delayed_parameter_initialization)}
    out.comm = comm_terms(spec, dims, cluster, job, tensors)
    step_time(out, spec, dims, cluster, job)
    return out


def model_state_memory(mem: dict, dims, cluster: Cluster, job: Job, spec, tensors: list[int]) -> None:
    """Parameters, gradients, optimizer state and the engine's working buffers of the largest rank."""
    cfg, pb = dims.cfg, element_bytes(dims.cfg)
    n_rank, rdp, stage, g = sum(tensors), dims.rdp, dims.zero_stage, dims.mics_group_size
    kept = sum(n for n in tensors if persistent(n, cfg))
    adam = 8 if job.optimizer == "adam" else 0
    mixed = pb == 2
    if g > 1:  # MiCS (torch FSDP2 on a (replicate, shard) mesh): every parameter sharded over the group of g = sdp
        # ranks only (sdp_param_persistence_threshold keeps nothing whole there: translate/mics.py)
        mem["parameters"] = math.ceil(n_rank / g) * pb
        mem["gradients"] = math.ceil(n_rank / g) * pb
        # Adam's moments, and the fp32 master only under fp16/bf16 (no DeepSpeed-style clone of fp32 weights)
        mem["optimizer_state"] = math.ceil(n_rank / g) * (adam + (4 if mixed else 0))
        # FSDP2's working set: the root unit (everything outside the layers) stays gathered from its
        # forward to the end of backward; each layer's units (plan/mics_units.py) are gathered for their
        # forward and again for their backward, one prefetched (two at a time), and their unsharded
        # gradients live until reduced
        units = mics_units(spec, dims)
        gathered = min(2, stage_layers(spec, dims.pp) * len(units.layer))
        working = (units.root + gathered * units.largest) * pb
        mem["mics_gathered_parameters"] = working
        mem["mics_unsharded_gradients"] = working
        return
    # Adam's fp32 moments, and fp32 master weights: under fp16/bf16, and always under ZeRO-1, whose
    # optimizer steps an fp32 copy of the rank's partition (DeepSpeed clones it even from fp32 weights);
    # an fp32 ZeRO-3 optimizer steps the partition itself (zero3.fp32_master_shared_with_partition)
    opt_per_param = adam + (4 if mixed or stage == 1 else 0)
    if stage == 3:  # DeepSpeed partitions over its whole data-parallel group (rdp); hpZ adds a second,
        # node-local copy sharded over sdp ranks (smp v1's MiCS sharded over sdp only: docs/plan.md)
        sharded = n_rank - kept
        mem["parameters"] = (kept + math.ceil(sharded / rdp)) * pb
        if dims.hpz_partition_size > 1:  # hpZ's secondary copy: a 1/hpz shard within the node group
            mem["parameters_hpz_secondary"] = math.ceil(sharded / dims.hpz_partition_size) * pb
        mem["gradients"] = math.ceil(n_rank / rdp) * pb
        mem["optimizer_state"] = math.ceil(n_rank / rdp) * opt_per_param
        # gathered during the step: the most DeepSpeed's coordinator holds gathered at once (plan/zero3.py:
        # what it keeps from forward to backward, the running module and what it prefetched)
        buffers = zero3_buffers(cfg, tensors)
        mem["zero3_gathered_parameters"] = zero3_gathers(spec, dims, job, tensors).peak * pb
        # DeepSpeed allocates the whole reduce bucket when the optimizer is built: sdp_reduce_bucket_size
        # elements when given, else its default bounded by the model (zero3_buffers)
        mem["gradient_buckets"] = buffers["reduce_bucket_size"] * pb
        return
    # pp > 1: the rank's own stage only (pipeline_stage_tensors), like its gradients and optimizer state
    mem["parameters"] = n_rank * pb
    mem["gradients"] = n_rank * pb
    mem["optimizer_state"] = math.ceil(n_rank / (rdp if stage == 1 else 1)) * opt_per_param
    if stage == 1 and rdp > 1:  # from backward's start to the step's end, fp32, two with overlap_comm
        # (the translation turns it on with NCCL, i.e. on GPUs)
        mem["gradient_buckets"] = ZERO1_REDUCE_BUCKET * 4 * (1 if cluster.cpu_ranks else 2)
    elif stage == 0 and rdp > 1:  # the engine flattens the gradients into one buffer to all-reduce them,
        # after backward (so never alive with the activations: Plan.overlap)
        mem["gradient_buckets"] = min(ZERO0_ALLREDUCE_BUFFER, n_rank) * pb


def activation_memory(spec, dims, job: Job) -> int:
    """The activations of the pipeline rank holding the most: stage 0 holds the most microbatches, the
    last stage the head: the larger of the two."""
    cfg, t, p = dims.cfg, dims.tp, dims.pp
    a = element_bytes(cfg)
    b = dims.micro_batch_size(job.batch)
    layers = stage_layers(spec, p)
    r = dims.tp_region_batch(b)  # samples inside the TP layers (t x b: smp gathers the TP group's batch)
    vocab_split = t > 1 and spec.vocab > 0 and any(split for _, split in spec.outer_tensors)
    per_layer = layer_activation_bytes(spec, b, r, t, a)
    boundary = a * b * spec.seq_len * spec.hidden  # a layer's input, kept when the layer is checkpointed
    # the head runs on the last stage, one microbatch at a time (its backward follows its forward);
    # the V schedules (zbv, dualpipev) put the last stage on rank 0
    head_rank = 0 if cfg.pipeline in V_SHAPED and p > 1 else p - 1
    held = []
    for stage in {0, p - 1}:
        n = in_flight_microbatches(dims, stage)
        if job.activation_checkpointing:  # every layer's input of each microbatch in flight, and one
            body = int(layers * boundary * n) + per_layer  # layer recomputed at a time in backward
        else:
            body = int(layers * per_layer * n)
        held.append(body + (head_activation_bytes(spec, b, r if vocab_split else b, a) if stage == head_rank else 0))
    return max(held)


class _Terms:
    """The CommTerms of rank 0's groups: a term of one smp.step call (per_call: repeated for each of the
    k calls of an optimizer step) or of the optimizer step (the reduction at the accumulation boundary)."""

    def __init__(self, dims, cluster: Cluster, k: int):
        groups = rank0_groups(dims)
        # a group is node-local when its ranks share a node (rank // GPUs per node: the ledger's rule)
        self.intra = {kind: len({r // cluster.gpus_per_node for r in ranks}) == 1 for kind, ranks in groups.items()}
        self.strides = {kind: ranks[1] - ranks[0] if len(ranks) > 1 else 1 for kind, ranks in groups.items()}
        self.k, self.terms = k, []

    def add(self, group, op, nbytes, calls, size, overlap=timing.EXPOSED, per_call=True):
        times = self.k if per_call else 1
        if size > 1 and nbytes > 0:
            self.terms.append(CommTerm(group, op, nbytes * times, calls * times, size, self.intra[group],
                                       self.strides[group], overlap))


def comm_terms(spec, dims, cluster: Cluster, job: Job, tensors: list[int]) -> list:
    """Bytes per optimizer step per (group, op) of rank 0, each with the phase it can hide behind."""
    terms = _Terms(dims, cluster, job.accumulation)
    if dims.mics_group_size > 1:
        _mics_terms(terms, spec, dims, tensors)
    elif dims.zero_stage == 3:
        _zero3_terms(terms, spec, dims, job, tensors)
    else:
        _replicated_terms(terms, dims, cluster, tensors)
    if dims.tp > 1:
        _tp_terms(terms, spec, dims, job)
    if dims.pp > 1:
        _pp_terms(terms, spec, dims, job)
    return terms.terms


def _replicated_terms(terms: _Terms, dims, cluster: Cluster, tensors: list[int]) -> None:
    """ZeRO-0/1: gradients reduced once per optimizer step, in buckets. ZeRO-0 after backward (the
    engine's all-reduce of its flat buffer, on the critical path); ZeRO-1 from backward hooks during the
    last microbatch's backward when overlap_comm is on (the translation's setting with NCCL), then the
    updated parameter shards gathered after the step. The pipeline engine reduces after its schedule."""
    n_rank, pb, rdp = sum(tensors), element_bytes(dims.cfg), dims.rdp
    grads = n_rank * pb
    if dims.zero_stage == 0:
        terms.add("rdp", "all_reduce", grads, math.ceil(n_rank / ZERO0_ALLREDUCE_BUFFER), rdp, per_call=False)
        return
    hooked = timing.LAST_BACKWARD if dims.pp == 1 and not cluster.cpu_ranks else timing.EXPOSED
    terms.add("rdp", "all_reduce", grads, math.ceil(n_rank / ZERO1_REDUCE_BUCKET), rdp, hooked, per_call=False)
    terms.add("rdp", "all_gather", grads, 1, rdp, per_call=False)  # the updated parameter shards


def _mics_terms(terms: _Terms, spec, dims, tensors: list[int]) -> None:
    """MiCS: every collective of the parameters and gradients stays inside the group of g ranks. Per
    microbatch (m per smp.step call, k calls per optimizer step), FSDP2 gathers the root unit once (kept
    through backward) and each unit of each layer twice (plan/mics_units.py; forward, then again for
    backward: reshard_after_forward; a checkpointed layer's recompute shares its backward gathers),
    prefetching one unit ahead, and reduce-scatters each unit's gradients on a side stream (every
    parameter is sharded on this engine). The replicas' all-reduce of each rank's 1/g gradient shard is deferred to the last
    microbatch (set_requires_all_reduce) and runs once per optimizer step from its backward hooks."""
    g, m, pb, n_rank = dims.mics_group_size, dims.cfg.microbatches, element_bytes(dims.cfg), sum(tensors)
    units = mics_units(spec, dims)
    layers = stage_layers(spec, dims.pp)
    calls = layers * len(units.layer)  # one collective per unit of each layer
    terms.add("sdp", "all_gather", (units.root + layers * units.layer_numel) * pb * m, (1 + calls) * m, g,
              timing.FORWARD)
    terms.add("sdp", "all_gather", layers * units.layer_numel * pb * m, calls * m, g, timing.BACKWARD)
    terms.add("sdp", "reduce_scatter", n_rank * pb * m, (1 + calls) * m, g, timing.BACKWARD)
    terms.add(REPLICATE_GROUP, "all_reduce", math.ceil(n_rank / g) * pb, 1 + calls, dims.rdp // g,
              timing.LAST_BACKWARD, per_call=False)


def _zero3_terms(terms: _Terms, spec, dims, job: Job, tensors: list[int]) -> None:
    """ZeRO-3: parameters below the persistence threshold stay whole and are gathered once, after the
    optimizer step. The others are gathered as DeepSpeed's coordinator fetches, prefetches and releases
    them over its trace of the n = m k passes (plan/zero3.py: DeepSpeed sees each of the k calls' m
    microbatches as one pass), each call in the phase it runs beside (a checkpointed recompute's in the
    backward). hpZ: a parameter's first gather in an optimizer step reads the primary partition (rdp)
    and builds the node-local copy, later ones read that copy inside the sdp group. overlap_comm
    reduce-scatters the gradients in reduce buckets beside the backward, every microbatch
    (zero3.reduce_calls)."""
    cfg, pb, rdp, m = dims.cfg, element_bytes(dims.cfg), dims.rdp, dims.cfg.microbatches
    kept_bytes = sum(x for x in tensors if persistent(x, cfg)) * pb
    terms.add("rdp", "all_gather", kept_bytes, 1, rdp, per_call=False)
    gathers = zero3_gathers(spec, dims, job, tensors)
    for phase, source in ((zero3.FORWARD, zero3.PRIMARY), (zero3.FORWARD, zero3.SECONDARY),
                          (zero3.BACKWARD, zero3.PRIMARY), (zero3.BACKWARD, zero3.SECONDARY)):
        calls, numel = gathers.counts.get((phase, source), (0, 0))
        group, size = ("sdp", dims.sdp) if source == zero3.SECONDARY else ("rdp", rdp)
        overlap = timing.FORWARD if phase == zero3.FORWARD else timing.BACKWARD
        terms.add(group, "all_gather", numel * pb, calls, size, overlap, per_call=False)
    terms.add("rdp", "reduce_scatter", sum(tensors) * pb * m * job.accumulation, gathers.reduce_calls, rdp,
              timing.BACKWARD, per_call=False)


def _tp_terms(terms: _Terms, spec, dims, job: Job) -> None:
    """Tensor parallelism's exchanges, all on the critical path (smp-adapter's Megatron-core layers run
    with allreduce_dgrad=False and no sequence parallelism). Per microbatch, m of them.
    prescaled_batch: the TP group shares one batch (r = b) and Megatron's pair surrounds each unit: its
    entry (copy_to) all-reduces the input's gradient in backward, its row layer (reduce_from) the output
    in forward, T = a x b x s x h each; a checkpointed layer's recompute repeats the attention's forward
    all-reduce (not the MLP's). The vocabulary-parallel embedding (stage 0) all-reduces its output, T, and
    a split position table one sample's worth. The head (the last stage: rank 0's when p = 1)
    all-reduces its input's gradient and all-gathers the logits (b x s x V).
    Without prescaled_batch: each unit (attention, MLP) gathers the TP group's batch on entry and
    reduce-scatters the row layer's partial sums; backward swaps the pair. A vocabulary-parallel
    embedding gathers the token ids and reduce-scatters its output; the vocabulary-parallel head gathers
    the hidden states and redistributes logits (all_to_all) for the loss. T = the TP group's activations
    of one microbatch. With activation checkpointing each layer's recompute repeats its forward
    exchanges up to the last tensor backward needs (torch's non-reentrant checkpoint stops there): both
    units' gathers and the attention's reduce-scatter, not the MLP's, whose output nothing keeps."""
    cfg, t, p, m = dims.cfg, dims.tp, dims.pp, dims.cfg.microbatches
    a, b, s, h = element_bytes(cfg), dims.micro_batch_size(job.batch), spec.seq_len, spec.hidden
    r = dims.tp_region_batch(b)
    vocab_split = spec.vocab > 0 and any(split for _, split in spec.outer_tensors)
    units = 2 * stage_layers(spec, p) * m
    ac = job.activation_checkpointing
    if cfg.prescaled_batch:
        T = a * b * s * h
        calls = 2 * units + (units // 2 if ac else 0)
        nbytes = calls * T
        if vocab_split:
            calls += m * (1 + spec.position_tables)
            nbytes += m * (T + spec.position_tables * a * s * h)
            if p == 1:
                calls += m
                nbytes += m * T
                terms.add("tp", "all_gather", m * a * b * s * spec.vocab, m, t)
        terms.add("tp", "all_reduce", nbytes, calls, t)
        return
    T = a * r * s * h
    edges = 2 * m if vocab_split else 0
    regather, rescatter = (units, units // 2) if ac else (0, 0)
    terms.add("tp", "all_gather", (2 * units + edges + regather) * T + (r * s * 8 * m if vocab_split else 0),
              2 * units + edges + regather + (m if vocab_split else 0), t)
    terms.add("tp", "reduce_scatter", (2 * units + edges + rescatter) * T, 2 * units + edges + rescatter, t)
    if vocab_split:
        terms.add("tp", "all_to_all", 2 * m * b * s * spec.vocab * a, 2 * m, t)


def _pp_terms(terms: _Terms, spec, dims, job: Job) -> None:
    """Stage 0 sends each microbatch's activations forward (and a decoder's causal mask, b x s x s
    booleans, which Hugging Face models build once and hand to every layer) and receives their
    gradients, v stages per rank each sending its own; the sends run beside the other microbatches'
    compute. Tied input/output embeddings (GPT-2) have their gradient all-reduced between the first and
    last stage after the schedule."""
    cfg, p, m = dims.cfg, dims.pp, dims.cfg.microbatches
    a, b = element_bytes(cfg), dims.micro_batch_size(job.batch)
    v = cfg.virtual_pipeline_degree
    act = a * b * spec.seq_len * spec.hidden * v
    mask = b * spec.seq_len * spec.seq_len * v if spec.vocab else 0
    terms.add("pp", "send", (act + mask) * m, (2 if mask else 1) * m * v, p, timing.NEIGHBOURS)
    terms.add("pp", "recv", act * m, m * v, p, timing.NEIGHBOURS)
    if spec.tied_embeddings:
        terms.add("pp", "all_reduce", spec.vocab * spec.hidden // dims.tp * element_bytes(cfg), 1, p, per_call=False)


def step_time(out: Plan, spec, dims, cluster: Cluster, job: Job) -> None:
    """Compute of the slowest rank, the communication its phases do not hide, the pipeline's bubble and
    fixed cost (plan/timing.py), and the throughput figures."""
    cfg, t, p, k, m = dims.cfg, dims.tp, dims.pp, job.accumulation, dims.cfg.microbatches
    prec = precision(cfg)
    peak = cluster.flops.get(prec)
    if peak is None:
        raise ValueError(f"{prec} is not supported by the GPU of {cluster.name}")
    # Each rank passes B samples to smp.step, k times per optimizer step. Without prescaled_batch the
    # TP group gathers its t batches and each rank computes 1/t of t·B samples: B samples' worth; with
    # prescaled_batch the group shares one batch: B / t. A pipeline stage holds 1/p of the layers.
    tokens = dims.tp_region_batch(job.batch) / t * spec.seq_len * k
    out.samples = dims.global_batch_size(job.batch) * k
    out.tokens = out.samples * spec.seq_len
    out.world = dims.world_size
    out.passes = 4 if job.activation_checkpointing else 3  # forward, backward = 2 x forward, recompute
    out.microbatches = m * k
    out.model_flops = timing.model_flops_per_token(spec) * out.tokens
    out.peak_flops = peak
    out.efficiency, out.efficiency_calibrated = timing.compute_efficiency(cluster.gpu, prec)
    # a pipeline runs at the pace of its slowest stage: the most layers (ceil(L / (p v)) per stage, v
    # stages per rank) and the head; without a pipeline the whole model
    v = cfg.virtual_pipeline_degree if p > 1 else 1
    slowest = timing.model_flops_per_token(spec, math.ceil(spec.layers / (p * v)) * v if p > 1 else None)
    out.compute_s = slowest / 3 * tokens * out.passes / (peak * out.efficiency)
    out.comm_s, out.exposed_comm_s = timing.exposed_seconds(out.comm, cluster, out.compute_s, m * k, out.passes)
    if p > 1:  # idle time of the schedule, and the fixed cost of its actions (timing.PIPELINE_ACTION_S)
        out.bubble_s = out.compute_s * timing.bubble_fraction(cfg.pipeline, p, m, v)
        out.overhead_s = timing.pipeline_overhead_s(cfg.pipeline, p, m * k, v)


def rank0_groups(dims) -> dict:
    """Rank 0's group of each kind, from the config layer's placement (the groups smp.init makes);
    groups of one kind are alike, so rank 0's stand for all. sdp: the group of sdp consecutive ranks
    of the rdp group (MiCS's sharding group, hpZ's node-local group), else rdp. replicate (MiCS): the
    ranks holding the same shard in every group, one per group (rank 0's: every sdp-th of its rdp group)."""
    grid = dims.grid
    rdp = grid.rdp_group(0)
    sdp = grid.sdp_groups(dims.sdp)[0] if dims.sdp_below_rdp else rdp
    return {"tp": grid.tp_group(0), "pp": grid.pp_group(0), "rdp": rdp, "sdp": tuple(sdp),
            REPLICATE_GROUP: tuple(rdp[::dims.sdp])}
