"""SageMaker GPU instance types: what ``smp-adapter plan --instance-type`` knows about each.

Every figure comes from a public source listed in docs/plan.md ("Instance table and sources"): AWS
instance pages for GPUs per node, host memory and network bandwidth; NVIDIA datasheets for peak dense
FLOP/s and NVLink; PyTorch's own report of a device's memory (``total_memory``, the "total capacity"
its out-of-memory messages print) for what the framework can allocate. Bandwidths are per direction,
in bytes/s: intra-node per GPU, inter-node per node (the node's network, shared by its GPUs). Peak
FLOP/s are dense (no sparsity); None where the GPU has no such arithmetic (T4 and V100 have no bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
TFLOPS = 10**12


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # nominal bytes (the datasheet's)
    usable_memory: int  # bytes PyTorch reports and can allocate (torch.cuda.get_device_properties().total_memory)
    flops: dict  # "fp32" / "fp16" / "bf16" -> peak dense FLOP/s (None: not supported)


@dataclass(frozen=True)
class Cluster:
    """What the arithmetic needs about the hardware."""

    name: str
    gpus_per_node: int
    nodes: int
    gpu_memory: int  # bytes per GPU: the nominal figure
    flops: dict  # "fp32" / "fp16" / "bf16" -> peak dense FLOP/s per GPU (None: not supported)
    intra_node_bandwidth: float  # bytes/s per direction, per GPU
    inter_node_bandwidth: float  # bytes/s per direction, per node
    usable_memory: int = 0  # bytes the framework can allocate per GPU; 0: the nominal figure
    host_memory: int = 0  # bytes of host memory per node; 0: not known
    gpu: str = ""  # the GPU's name (the compute-efficiency table's key); "": described by the user
    # the collective library the ranks use: "nccl" (GPUs) or "gloo" (CPU ranks, whose reduce_scatter is an
    # all-reduce followed by a slice: it sends what an all-reduce sends; timing.ring_factor)
    collectives: str = "nccl"
    # seconds: a collective call's fixed cost, and each ring step's wait for one hop inside a node and
    # between nodes (NCCL_LATENCY for GPUs; 0 for CPU ranks, whose per-call cost the measured gloo
    # efficiency includes: RESULTS.md §16)
    call_latency: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_latency: float = 0.0

    @property
    def cpu_ranks(self) -> bool:
        """Ranks on CPUs (gloo): no CUDA context, no side streams to overlap communication on."""
        return self.collectives == "gloo"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def allocatable(self) -> int:
        """Device bytes a job can use: what PyTorch reports (A100 40GB: 39.59 GiB), not the nominal 40."""
        return self.usable_memory or self.gpu_memory


def _gpu(name, memory_gib, usable_gib, fp32, fp16, bf16) -> GPU:
    return GPU(name, int(memory_gib * GiB), int(usable_gib * GiB),
               {"fp32": fp32 * TFLOPS, "fp16": fp16 * TFLOPS, "bf16": bf16 * TFLOPS if bf16 else None})


# name, nominal GiB, usable GiB (PyTorch's total_memory), peak dense fp32 / fp16 / bf16 TFLOP/s
A100_40 = _gpu("A100-40GB", 40, 39.59, 19.5, 312, 312)
A100_80 = _gpu("A100-80GB", 80, 79.14, 19.5, 312, 312)
H100_SXM = _gpu("H100-SXM-80GB", 80, 79.11, 67, 989, 989)
H200 = _gpu("H200-141GB", 141e9 / GiB, 139.80, 67, 989, 989)
V100_16 = _gpu("V100-SXM2-16GB", 16, 15.78, 15.7, 125, None)
V100_32 = _gpu("V100-SXM2-32GB", 32, 31.74, 15.7, 125, None)
A10G = _gpu("A10G", 24, 21.99, 35, 70, 70)
T4 = _gpu("T4", 16, 14.56, 8.1, 65, None)
L4 = _gpu("L4", 24, 21.99, 30.3, 121, 121)
L40S = _gpu("L40S", 48, 44.49, 91.6, 362, 362)
NVLINK2 = 150 * GB  # V100 SXM2: 300 GB/s both directions (p3's hybrid cube mesh: not every pair is linked)
NVLINK3 = 300 * GB  # A100 NVLink: 600 GB/s both directions
NVLINK4 = 450 * GB  # H100 / H200 SXM NVLink: 900 GB/s both directions
PCIE3, PCIE4 = 16 * GB, 32 * GB  # x16 link, per direction
GBIT = GB / 8
US = 1e-6
# NCCL's own latency model for ring collectives with the Simple protocol (the one large messages use),
# src/graph/tuning.cc: baseLat 8.4 us per call, hwLat per ring step 3.4 us over NVLink, 5.7 us over
# PCIe, 14.0 us over the network. One call costs base + steps x hop.
NCCL_LATENCY = {"call": 8.4 * US, "nvlink": 3.4 * US, "pcie": 5.7 * US, "net": 14.0 * US}


def intra_node_link(bandwidth: float) -> str:
    """The link class of an intra-node bandwidth of the table: NVLink figures are above any PCIe x16's."""
    return "nvlink" if bandwidth > PCIE4 * 2 else "pcie"

# name -> (GPU, GPUs per node, intra-node bandwidth per GPU, inter-node bandwidth per node, host memory GiB)
INSTANCE_TYPES = {
    "ml.p3.16xlarge": (V100_16, 8, NVLINK2, 25 * GBIT, 488),
    "ml.p3dn.24xlarge": (V100_32, 8, NVLINK2, 100 * GBIT, 768),
    "ml.p4d.24xlarge": (A100_40, 8, NVLINK3, 400 * GBIT, 1152),
    "ml.p4de.24xlarge": (A100_80, 8, NVLINK3, 400 * GBIT, 1152),
    "ml.p5.48xlarge": (H100_SXM, 8, NVLINK4, 3200 * GBIT, 2048),
    "ml.p5e.48xlarge": (H200, 8, NVLINK4, 3200 * GBIT, 2048),
    "ml.p5en.48xlarge": (H200, 8, NVLINK4, 3200 * GBIT, 2048),
    "ml.g5.xlarge": (A10G, 1, PCIE4, 10 * GBIT, 16),
    "ml.g5.2xlarge": (A10G, 1, PCIE4, 10 * GBIT, 32),
    "ml.g5.12xlarge": (A10G, 4, PCIE4, 40 * GBIT, 192),
    "ml.g5.24xlarge": (A10G, 4, PCIE4, 50 * GBIT, 384),
    "ml.g5.48xlarge": (A10G, 8, PCIE4, 100 * GBIT, 768),
    "ml.g4dn.12xlarge": (T4, 4, PCIE3, 50 * GBIT, 192),
    "ml.g6.12xlarge": (L4, 4, PCIE4, 40 * GBIT, 192),
    "ml.g6.24xlarge": (L4, 4, PCIE4, 50 * GBIT, 384),
    "ml.g6.48xlarge": (L4, 8, PCIE4, 100 * GBIT, 768),
    "ml.g6e.12xlarge": (L40S, 4, PCIE4, 100 * GBIT, 384),
    "ml.g6e.24xlarge": (L40S, 4, PCIE4, 200 * GBIT, 768),
    "ml.g6e.48xlarge": (L40S, 8, PCIE4, 400 * GBIT, 1536),
}


# Nodes outside SageMaker, for a user leaving it: name -> (GPU, GPUs per node, intra-node bandwidth per
# GPU, inter-node bandwidth per node, host memory GiB; 0: not known). Sources in docs/plan.md ("Node
# presets"): the NVIDIA DGX datasheets for the SXM nodes (DGX H100 / H200: 8 ConnectX-7 at 400 Gbit/s,
# 2 TB; DGX A100: 8 ConnectX-6 at 200 Gbit/s, 1 TB for 40GB GPUs, 2 TB for 80GB), which HGX servers
# from other vendors follow; PCIe nodes have no reference design, so their network is a stated guess a
# user should replace (--cluster FILE): 100 Gbit/s for L4 / L40S servers, 50 Gbit/s for T4 (g4dn's).
NODE_PRESETS = {
    "8xH100-SXM": (H100_SXM, 8, NVLINK4, 3200 * GBIT, 2048),
    "8xH200-SXM": (H200, 8, NVLINK4, 3200 * GBIT, 2048),
    "8xA100-SXM-80GB": (A100_80, 8, NVLINK3, 1600 * GBIT, 2048),
    "8xA100-SXM-40GB": (A100_40, 8, NVLINK3, 1600 * GBIT, 1024),
    "8xL40S-PCIe": (L40S, 8, PCIE4, 100 * GBIT, 0),
    "8xL4-PCIe": (L4, 8, PCIE4, 100 * GBIT, 0),
    "4xL4-PCIe": (L4, 4, PCIE4, 100 * GBIT, 0),
    "4xT4-PCIe": (T4, 4, PCIE3, 50 * GBIT, 0),
}
GPUS = {g.name: g for g in (A100_40, A100_80, H100_SXM, H200, V100_16, V100_32, A10G, T4, L4, L40S)}


def table_cluster(name: str, entry: tuple, count: int) -> Cluster:
    """A Cluster of ``count`` nodes of a table entry (INSTANCE_TYPES, NODE_PRESETS): NCCL's latencies for
    the entry's link classes."""
    gpu, per_node, intra, inter, host_gib = entry
    return Cluster(name, per_node, count, gpu.memory, gpu.flops, intra, inter, gpu.usable_memory, host_gib * GiB,
                   gpu.name, call_latency=NCCL_LATENCY["call"], intra_node_latency=NCCL_LATENCY[intra_node_link(intra)],
                   inter_node_latency=NCCL_LATENCY["net"])


def check_count(count, flag: str = "--instance-count") -> None:
    from smp_adapter.plan.input_errors import PlanInputError

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlanInputError("instance count", flag, "must be a positive integer", "give the number of nodes", count)


def node_cluster(name: str, count: int) -> Cluster:
    """``plan --node NAME``: a preset node (NODE_PRESETS)."""
    from smp_adapter.plan.input_errors import PlanInputError

    if name not in NODE_PRESETS:
        import difflib

        close = difflib.get_close_matches(str(name), list(NODE_PRESETS), n=2, cutoff=0.5)
        raise PlanInputError("node", "--node", "is not a node preset plan knows",
                             (f"did you mean {' or '.join(close)}? " if close else "")
                             + f"Use one of {', '.join(NODE_PRESETS)}, or describe your nodes with --cluster FILE", name)
    check_count(count)
    return table_cluster(name, NODE_PRESETS[name], count)


def instance_cluster(name: str, count: int) -> Cluster:
    from smp_adapter.plan.input_errors import PlanInputError

    if name not in INSTANCE_TYPES:
        import difflib

        close = difflib.get_close_matches(str(name), list(INSTANCE_TYPES), n=2, cutoff=0.6)
        raise PlanInputError("instance type", "--instance-type", "is not a SageMaker GPU instance type plan knows",
                             (f"did you mean {' or '.join(close)}? " if close else "")
                             + f"Use one of {', '.join(INSTANCE_TYPES)}; outside SageMaker, --node {' | '.join(NODE_PRESETS)} "
                             "or --cluster FILE (docs/plan.md)", name)
    check_count(count)
    return table_cluster(name, INSTANCE_TYPES[name], count)
