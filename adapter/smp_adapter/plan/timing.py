"""The step-time model of ``smp-adapter plan``, written once (docs/plan.md, "Time"): compute at a
stated efficiency per GPU type and precision, collectives at a stated share of the link bandwidth plus
NCCL's per-call latency, each collective hidden behind the compute of its own phase (forwards, backwards,
the last microbatch's backward, the pipeline's other microbatches) link by link, the pipeline bubble
of each schedule, and the figures a practitioner compares runs by (tokens/s per GPU, MFU). Pure
arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMM_EFFICIENCY = 0.70  # achieved / link bandwidth of large NCCL collectives (bus bandwidth): stated, not calibrated
# gloo over TCP between CPU ranks: achieved / the link's rate. Stated before measuring (TCP reaches ~0.96 of a
# tbf-shaped link, gloo's rings less); the jobs of benchmarks/cluster_comm.py --plan then moved their link
# bytes at 0.87-0.92 of the rate beside their compute (RESULTS.md §16)
GLOO_COMM_EFFICIENCY = 0.85

# Achieved / peak FLOP/s of the compute of a transformer training step, recompute included (hardware
# FLOPs utilisation of the compute phases, before communication and bubbles), per GPU and precision.
# Calibrated entries: the hardware utilisation of published runs whose communication was hidden
# (docs/plan.md, "Calibration", cites each); the others are stated assumptions.
COMPUTE_EFFICIENCY = {
    # A100, 16-bit: MosaicML llm-foundry benchmarks (FSDP FULL_SHARD, A100 40/80GB): HFU 42.6-79.3 %
    # (7B: 66.8 % on 8 x A100-40GB at seq 4096); torchtitan (FSDP2, 64 x A100-80GB): MFU 50.5-61.1 %
    ("A100-40GB", "bf16"): 0.60, ("A100-40GB", "fp16"): 0.60,
    ("A100-80GB", "bf16"): 0.60, ("A100-80GB", "fp16"): 0.60,
    # H100 / H200 (same die), 16-bit: llm-foundry H100 HFU 31.8-59.0 % (7B seq 4096: 53.9 %); torchtitan
    # Llama 3.1 8B on H100: MFU 33-39 %; Llama 3 405B: MFU 38-43 % (paper, Table 4)
    ("H100-SXM-80GB", "bf16"): 0.50, ("H100-SXM-80GB", "fp16"): 0.50,
    ("H200-141GB", "bf16"): 0.50, ("H200-141GB", "fp16"): 0.50,
    # V100, fp16: Megatron-LM v1.0 sustained 62.4 TFLOP/s per GPU, 48 % of peak (NVIDIA ADLR blog)
    ("V100-SXM2-16GB", "fp16"): 0.48, ("V100-SXM2-32GB", "fp16"): 0.48,
}
# CPU ranks (a cluster described with --collectives gloo), fp32, against the rate of a 1024 x 1024 fp32
# matmul measured with as many processes computing at once as the job has ranks on the machine: calibrated on
# the GPT-2 of benchmarks/cluster_comm.py --plan, whose training step alone in one process (4 at once) ran at
# 0.80 of that probe's rate (0.586 s against 0.469 s at the probe's 35.2 GFLOP/s; RESULTS.md §16)
COMPUTE_EFFICIENCY[("cpu", "fp32")] = 0.80
# not calibrated: fp32 matmuls without tensor cores reach a larger share of their (much lower) peak
ASSUMED_EFFICIENCY = {"fp32": 0.60, "fp16": 0.40, "bf16": 0.40}


def compute_efficiency(gpu: str, precision: str) -> tuple[float, bool]:
    """(efficiency, calibrated) for a GPU name (instances.py) and a precision."""
    if (gpu, precision) in COMPUTE_EFFICIENCY:
        return COMPUTE_EFFICIENCY[gpu, precision], True
    return ASSUMED_EFFICIENCY[precision], False


def model_flops_per_token(spec, layers: int | None = None) -> float:
    """Training FLOPs per token of the model itself (PaLM's MFU numerator, Chowdhery et al. 2022, App. B):
    6 x the matrix parameters (the layers' matrices and the token head) + 12 L s h for attention's
    two s x s products. Recompute is not counted (it is not the model's work). ``layers``: of that
    many layers and the head (a pipeline's slowest stage: its most layers and the head)."""
    layers = spec.layers if layers is None else layers
    matmul = layers * sum(n for n, split in spec.layer_tensors if split) + spec.vocab * spec.hidden
    return 6 * matmul + 12 * layers * spec.seq_len * spec.hidden


def bubble_fraction(schedule: str, p: int, m: int, v: int) -> float:
    """Idle time of a pipeline step as a share of its compute: b / m, b in units of one microbatch's
    F + B on a rank, with a weight-gradient share w = W / (F + B) = 1/3 (F, dX and dW are one matrix
    product each): 1F1B and GPipe p - 1; interleaved 1F1B (p - 1) / v (Narayanan et al. 2021); ZB-H1
    (zero_bubble) (p - 1)(1 - 2w) (Qi et al. 2023), / v when looped; ZBV (p - 1)(1 - 2w) / 2; DualPipeV
    max(0, (p - 1)(1 - 3w) / 2) = 0. The same predictions benchmarks/pipeline.py prints next to each
    rank's measured idle fraction (RESULTS.md §11.1)."""
    if p <= 1:
        return 0.0
    w = 1 / 3
    b = {"interleaved": p - 1, "simple": p - 1, "interleaved_1f1b": (p - 1) / v,
         "zero_bubble": (p - 1) * (1 - 2 * w) / v, "zbv": (p - 1) * (1 - 2 * w) / 2,
         "dualpipev": max(0.0, (p - 1) * (1 - 3 * w) / 2)}.get(schedule, p - 1)
    return b / m


# Fixed cost of one pipeline action (one stage's forward, backward or weight-gradient pass of one
# microbatch): the schedule's Python, the send/receive set-up, kernel launches that do not overlap.
# Stated, not measured on a GPU; on the 2-core CPU machine the excess over the ideal pipeline was
# ~1.6 ms per action (RESULTS.md §3: pp 2, m 16, 52 ms for 32 actions), an upper bound for GPUs.
PIPELINE_ACTION_S = 0.5e-3


def pipeline_overhead_s(schedule: str, p: int, microbatches: int, v: int) -> float:
    """Per-action overhead of a rank: forward and backward (and a separate weight-gradient pass under
    the split-backward schedules) of each microbatch on each of its v stages."""
    if p <= 1:
        return 0.0
    passes = 3 if schedule in ("zero_bubble", "zbv", "dualpipev") else 2
    return PIPELINE_ACTION_S * microbatches * v * passes


def ring_factor(op: str, n: int, collectives: str = "nccl") -> float:
    """Bytes each rank sends per byte of the collective (ring algorithms, NCCL's choice for large
    messages): all_reduce 2 (n-1)/n, all_gather / reduce_scatter (n-1)/n, send the message. Gloo's
    reduce_scatter runs an all-reduce and keeps its slice: 2 (n-1)/n (probed on namespaced nodes,
    benchmarks/RESULTS.md §14)."""
    if op == "all_reduce" or (op == "reduce_scatter" and collectives == "gloo"):
        return 2 * (n - 1) / n
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def ring_steps(op: str, n: int) -> int:
    """Steps of a ring collective, each waiting for one hop's latency: all_reduce 2 (n-1) (reduce-scatter
    then all-gather), all_gather / reduce_scatter / all_to_all n - 1, a send 1 (NCCL's tuning model counts
    them so: src/graph/tuning.cc, nsteps)."""
    if op == "all_reduce":
        return 2 * (n - 1)
    return 1 if op in ("send", "recv") else n - 1


def rings_on_node_link(term, cluster) -> int:
    """How many of the term's rings (one per group: the node's GPUs in different groups of this kind)
    cross one node's network link at once: a group spanning nodes has one edge leaving each node."""
    n = term.size
    return cluster.gpus_per_node // max(1, min(n, cluster.gpus_per_node // max(1, term.stride)))


def link_bytes_per_node(term, cluster) -> float:
    """Bytes one node sends over its network link for a term (0 inside a node): the rings sharing the
    link, each sending its ring's bytes per rank over the node's one outgoing edge. What a node's
    network interface counts (benchmarks/cluster_comm.py compares it with the kernel's counters)."""
    if term.intra_node or term.op == "recv":
        return 0.0
    return term.bytes * ring_factor(term.op, term.size, cluster.collectives) * rings_on_node_link(term, cluster)


def comm_efficiency(cluster) -> float:
    return GLOO_COMM_EFFICIENCY if cluster.collectives == "gloo" else COMM_EFFICIENCY


def latency_seconds(term, cluster) -> float:
    """The term's fixed cost per call: the library's launch cost (cluster.call_latency) + one hop's
    latency per ring step, at the slowest link the ring crosses (a ring step waits for its slowest hop)."""
    if term.op == "recv" or term.calls <= 0:
        return 0.0
    hop = cluster.intra_node_latency if term.intra_node else cluster.inter_node_latency
    return term.calls * (cluster.call_latency + ring_steps(term.op, term.size) * hop)


def bandwidth_seconds(term, cluster) -> float:
    """A term's bytes at a share of the link bandwidth (comm_efficiency). A group spanning nodes runs at
    the node's network bandwidth shared by the rings of the node that take part, else at the
    intra-node link."""
    if term.op == "recv":
        return 0.0  # a send and its receive are one transfer; counted with the send
    factor = ring_factor(term.op, term.size, cluster.collectives)
    if term.intra_node:
        bandwidth = cluster.intra_node_bandwidth
    else:
        bandwidth = min(cluster.intra_node_bandwidth, cluster.inter_node_bandwidth / rings_on_node_link(term, cluster))
    return term.bytes * factor / (bandwidth * comm_efficiency(cluster))


def collective_seconds(term, cluster) -> float:
    """A term's time: its bytes over the link it is bound by, plus its calls' latency."""
    return bandwidth_seconds(term, cluster) + latency_seconds(term, cluster)


# The phase a CommTerm can hide behind (CommTerm.overlap): the compute the engine runs it beside.
EXPOSED = ""  # on the critical path (TP's exchanges, ZeRO-0's all-reduce after backward, ZeRO-1's parameter gather)
FORWARD = "forward"  # gathers prefetched during the forward passes (ZeRO-3, hpZ, MiCS)
BACKWARD = "backward"  # during recompute + backward of every microbatch (re-gathers, reduce-scatters)
LAST_BACKWARD = "last_backward"  # backward hooks at the accumulation boundary: the last microbatch's
# recompute + backward only (ZeRO-1's reduction with overlap_comm, MiCS's replica all-reduce)
NEIGHBOURS = "neighbours"  # pipeline sends, beside the other microbatches' compute
PHASES = (FORWARD, BACKWARD, LAST_BACKWARD, NEIGHBOURS)
INTRA, INTER = "intra-node", "inter-node"


@dataclass
class Phase:
    """One overlap window: the compute it offers, the collectives' seconds on each link inside it, and
    what shows (the busiest link's excess: the links run at once, each collective on its own stream)."""

    name: str
    window_s: float
    links: dict = field(default_factory=dict)  # INTRA / INTER -> seconds

    @property
    def comm_s(self) -> float:
        return max(self.links.values(), default=0.0)

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.comm_s - self.window_s)


def phase_windows(compute_s: float, passes: int, microbatches: int) -> dict:
    """Compute seconds of each window, from the step's compute of ``passes`` forward-equivalents (3, or 4
    with recompute) over ``microbatches`` (m x k): the forwards (1 of the passes); recompute + backward
    of all but the last microbatch; of the last one; and for pipeline sends every microbatch but one
    (the first forward's send and the last backward's have nothing of the rank's to hide behind)."""
    n = max(1, microbatches)
    backward = compute_s * (passes - 1) / passes
    return {FORWARD: compute_s / passes, BACKWARD: backward * (n - 1) / n, LAST_BACKWARD: backward / n,
            NEIGHBOURS: compute_s * (n - 1) / n}


def phases(terms, cluster, compute_s: float, microbatches: int, passes: int) -> tuple[list, float]:
    """(the overlap windows with their traffic, seconds on the critical path). BACKWARD traffic runs
    through every microbatch's backward: its last microbatch's share lands in the LAST_BACKWARD window,
    beside the reduction the hooks start there. On CPU ranks (gloo) nothing is hidden: the engines
    overlap on CUDA side streams, and a CPU rank's collectives run in line with its compute (measured:
    benchmarks/cluster_comm.py --plan, RESULTS.md §16)."""
    windows = phase_windows(compute_s, passes, microbatches)
    out = {name: Phase(name, windows[name]) for name in PHASES}
    exposed = 0.0
    n = max(1, microbatches)
    for term in terms:
        seconds = collective_seconds(term, cluster)
        if cluster.cpu_ranks or term.overlap not in out:
            exposed += seconds
            continue
        link = INTRA if term.intra_node else INTER
        shares = {BACKWARD: (n - 1) / n, LAST_BACKWARD: 1 / n} if term.overlap == BACKWARD else {term.overlap: 1.0}
        for name, share in shares.items():
            out[name].links[link] = out[name].links.get(link, 0.0) + seconds * share
    return [p for p in out.values() if any(v > 0 for v in p.links.values())], exposed


def exposed_seconds(terms, cluster, compute_s: float, microbatches: int, passes: int) -> tuple[float, float]:
    """(all communication seconds, the part not hidden behind compute): the critical-path terms, plus
    each window's excess of its busiest link over the window's compute."""
    windows, exposed = phases(terms, cluster, compute_s, microbatches, passes)
    total = sum(collective_seconds(t, cluster) for t in terms)
    return total, exposed + sum(p.exposed_s for p in windows)
