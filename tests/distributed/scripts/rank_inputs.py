"""Writes what this rank was given to <--out>/rank<RANK>.json: its arguments, working directory, the
environment variables `smp-adapter launch` sets for a job, and (after importing smp, as a training
script does) the state torch computes with and a fingerprint of a few computations' bits
(test_launch.py compares ranks started by the launcher with ranks started by launch_util.run_as_launched)."""

import hashlib
import json
import os
import sys

# what launch sets (its --dry-run's exports) and the launcher's rank coordinates; not the rendezvous
# port (each start picks its own), the launch process's identity (SMP_ADAPTER_LAUNCH_PROCESS, which a forked
# rank has no launch process to name) nor launcher-private variables (TORCHELASTIC_*, CROSS_RANK, ...)
KEPT = ("PYTHONPATH", "DS_ACCELERATOR", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "MASTER_ADDR")
# variables the numerical libraries under torch read (threads, instruction sets, reproducibility);
# not torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING (NCCL only)
NUMERIC_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "OPENBLAS_", "ONEDNN_", "DNNL_", "TORCH_")
NOT_NUMERIC = ("TORCH_NCCL_",)


def numerics() -> dict:
    """What decides the numbers a rank computes, read after ``import smdistributed.modelparallel.torch``."""
    import torch

    import smdistributed.modelparallel.torch  # noqa: F401  (what a training script imports first)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    a, b = torch.randn(96, 80, generator=g), torch.randn(80, 72, generator=g)
    bits = hashlib.sha256()
    for t in (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),  # float32 attention
              torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).float(),
              a @ b, torch.nn.functional.gelu(a).sum(0), torch.softmax(a, -1), torch.nn.functional.layer_norm(a, (80,))):
        bits.update(t.contiguous().numpy().tobytes())
    cuda_sdp = torch.backends.cuda
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(), "default_dtype": str(torch.get_default_dtype()),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic": torch.are_deterministic_algorithms_enabled(), "mkldnn": torch.backends.mkldnn.enabled,
            "sdp": {"flash": cuda_sdp.flash_sdp_enabled(), "math": cuda_sdp.math_sdp_enabled(),
                    "mem_efficient": cuda_sdp.mem_efficient_sdp_enabled()},
            "env": {k: v for k, v in os.environ.items() if k.startswith(NUMERIC_ENV) and not k.startswith(NOT_NUMERIC)},
            "fingerprint": bits.hexdigest()}


out = sys.argv[sys.argv.index("--out") + 1]
seen = {"argv": sys.argv[1:], "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items()
                if (k.startswith(("SM_", "SMP_ADAPTER_")) or k in KEPT) and k != "SMP_ADAPTER_LAUNCH_PROCESS"}}
if "--numerics" in sys.argv:
    seen["numerics"] = numerics()
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f, sort_keys=True)
