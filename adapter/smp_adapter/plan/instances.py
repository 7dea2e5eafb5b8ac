"""SageMaker GPU instance types: what ``smp-adapter plan --instance-type`` knows about each.

Every figure comes from a public source listed in docs/plan.md (AWS instance pages for GPUs per
node, GPU memory and network bandwidth; NVIDIA datasheets for peak dense FLOP/s; PCIe / NVLink
specifications for intra-node bandwidth). Bandwidths are per direction, in bytes/s: intra-node per
GPU, inter-node per node (the node's network, shared by its GPUs). Peak FLOP/s are dense (no
sparsity); None where the GPU has no such arithmetic (T4 has no bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
TFLOPS = 10**12


@dataclass(frozen=True)
class Cluster:
    """What the arithmetic needs about the hardware."""

    name: str
    gpus_per_node: int
    nodes: int
    gpu_memory: int  # bytes per GPU
    flops: dict  # "fp32" / "fp16" / "bf16" -> peak dense FLOP/s per GPU (None: not supported)
    intra_node_bandwidth: float  # bytes/s per direction, per GPU
    inter_node_bandwidth: float  # bytes/s per direction, per node

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def _gpu(memory_gib, fp32, fp16, bf16):
    return {"gpu_memory": int(memory_gib * GiB),
            "flops": {"fp32": fp32 * TFLOPS, "fp16": fp16 * TFLOPS, "bf16": bf16 * TFLOPS if bf16 else None}}


A100_40, A100_80 = _gpu(40, 19.5, 312, 312), _gpu(80, 19.5, 312, 312)
H100_SXM = _gpu(80, 67, 989, 989)
A10G = _gpu(24, 31.2, 125, 125)
T4 = _gpu(16, 8.1, 65, None)
L4 = _gpu(24, 30.3, 121, 121)
L40S = _gpu(48, 91.6, 362, 362)
NVLINK3 = 300 * GB  # A100 NVLink: 600 GB/s both directions
NVLINK4 = 450 * GB  # H100 SXM NVLink: 900 GB/s both directions
PCIE3, PCIE4 = 16 * GB, 32 * GB  # x16 link, per direction
GBIT = GB / 8

# name -> (GPU, GPUs per node, intra-node bandwidth per GPU, inter-node bandwidth per node)
INSTANCE_TYPES = {
    "ml.p4d.24xlarge": (A100_40, 8, NVLINK3, 400 * GBIT),
    "ml.p4de.24xlarge": (A100_80, 8, NVLINK3, 400 * GBIT),
    "ml.p5.48xlarge": (H100_SXM, 8, NVLINK4, 3200 * GBIT),
    "ml.g5.xlarge": (A10G, 1, PCIE4, 10 * GBIT),
    "ml.g5.2xlarge": (A10G, 1, PCIE4, 10 * GBIT),
    "ml.g5.12xlarge": (A10G, 4, PCIE4, 40 * GBIT),
    "ml.g5.24xlarge": (A10G, 4, PCIE4, 50 * GBIT),
    "ml.g5.48xlarge": (A10G, 8, PCIE4, 100 * GBIT),
    "ml.g4dn.12xlarge": (T4, 4, PCIE3, 50 * GBIT),
    "ml.g6.12xlarge": (L4, 4, PCIE4, 40 * GBIT),
    "ml.g6.24xlarge": (L4, 4, PCIE4, 50 * GBIT),
    "ml.g6.48xlarge": (L4, 8, PCIE4, 100 * GBIT),
    "ml.g6e.12xlarge": (L40S, 4, PCIE4, 100 * GBIT),
    "ml.g6e.24xlarge": (L40S, 4, PCIE4, 200 * GBIT),
    "ml.g6e.48xlarge": (L40S, 8, PCIE4, 400 * GBIT),
}


def instance_cluster(name: str, count: int) -> Cluster:
    from smp_adapter.config.problems import ConfigProblem, raise_if_any

    if name not in INSTANCE_TYPES:
        raise_if_any([ConfigProblem("--instance-type", "is not a SageMaker GPU instance type plan knows",
                                    f"use one of {', '.join(INSTANCE_TYPES)}, or describe the hardware with "
                                    "--gpus-per-node --gpu-memory --intra-node-bandwidth --inter-node-bandwidth --gpu-flops",
                                    name)])
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise_if_any([ConfigProblem("--instance-count", "must be a positive integer", "give the number of nodes", count)])
    gpu, per_node, intra, inter = INSTANCE_TYPES[name]
    return Cluster(name, per_node, count, gpu["gpu_memory"], gpu["flops"], intra, inter)
