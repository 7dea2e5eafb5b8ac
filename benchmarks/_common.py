"""Shared by the benchmark programs: start N local ranks (the way tests/distributed/launch_util.py
does: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* env, gloo on CPU), the benchmark model and data,
and the hand-written DeepSpeed config derived from the adapter's translation.

Nothing here imports smp_adapter at module level: the native-only memory jobs must not pay for it.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The benchmark model: GPT-2 style, no dropout. Sized so one optimizer step (per-rank batch 4,
# 2 microbatches, 128 tokens) takes ~100-200 ms per rank on the 2-core CPU of the dev machine.
MODEL = dict(n_embd=128, n_layer=2, n_head=4, vocab_size=4096, n_positions=128)
SEQ = 128
PER_RANK_BATCH = 4
MICROBATCHES = 2
LR = 1e-4

# Each benchmarked parallelism mode: smp options and the number of processes.
# sdp_param_persistence_threshold: the smp default (1e6 elements) would keep every matrix of this
# small model whole on every rank, so ZeRO-3 would gather nothing; 1e4 keeps only biases and
# LayerNorms persistent, as the default does for a billion-parameter model.
SDP = {"sdp_param_persistence_threshold": 10_000}
MODES = {
    "zero0": ({"ddp": True, "microbatches": MICROBATCHES}, 2, "ZeRO 0 (ddp)"),
    "zero1": ({"ddp": True, "shard_optimizer_state": True, "microbatches": MICROBATCHES}, 2,
              "ZeRO 1 (shard_optimizer_state)"),
    "zero3": ({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": MICROBATCHES, **SDP}, 2,
              "ZeRO 3 (sdp 2 of 2)"),
    "hpz": ({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": MICROBATCHES, **SDP}, 4,
            "hpZ (sdp 2 of 4)"),
    # not in the default run: one rank (benchmarks/checkpoint.py --digests --modes dp1: a rank with a spare core)
    "dp1": ({"ddp": True, "microbatches": MICROBATCHES}, 1, "one rank (dp 1)"),
    # not in the default run: two pipeline stages (benchmarks/checkpoint.py --modes pp2)
    "pp2": ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": MICROBATCHES}, 2, "pp 2"),
    # not in the default run: the bigger size, smp's own sdp defaults (run with --native defaults)
    "zero3_big": ({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": MICROBATCHES}, 2,
                  "ZeRO 3, GPT-2 n_embd 256 x 4 layers, smp's sdp defaults"),
}
DEFAULT_MODES = ("zero0", "zero1", "zero3", "hpz")
# model sizes of the modes that do not use MODEL
MODE_MODEL = {"zero3_big": dict(n_embd=256, n_layer=4, n_head=4)}


# -- launching ---------------------------------------------------------------------------------
def free_port() -> int:
    """A rendezvous port below the kernel's ephemeral range (smp_adapter/launch/free_port.py says why)."""
    if str(ROOT / "adapter") not in sys.path:
        sys.path.insert(0, str(ROOT / "adapter"))
    from smp_adapter.launch.free_port import free_port as pick

    return pick()


def run_ranks(script: Path, nprocs: int, args, out_dir: Path, env: dict | None = None,
              timeout: float = 280) -> list[dict]:
    """Start ``nprocs`` ranks of ``script``; return each rank's JSON ($BENCH_OUT/rank<R>.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "OMPI_", "RANK", "LOCAL_", "WORLD_"))}
    base.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "adapter"), base.get("PYTHONPATH", "")]),
                 "BENCH_OUT": str(out_dir)})
    base.setdefault("OMP_NUM_THREADS", "1")
    # the "hpz" mode (sdp 2 of 4) is DeepSpeed's ZeRO-3 + hpZ, measured against hand-written DeepSpeed doing
    # the same; the MiCS engine (the adapter's default for sdp < rdp) is measured by cluster_comm.py
    base.setdefault("SMP_ADAPTER_SDP_ENGINE", "hpz")
    import torch

    if not torch.cuda.is_available():
        base.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    base.update(env or {})
    if os.environ.get("SMP_BENCH_FORK_RANKS") == "1":
        _fork_ranks(script, nprocs, args, out_dir, base, timeout)
        return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]
    procs, logs = [], []
    for rank in range(nprocs):
        e = dict(base, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(out_dir / f"log{rank}.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=e, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(out_dir)))
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"ranks did not finish in {timeout}s:\n" + _logs(out_dir, nprocs))
    finally:
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"exit codes {codes}:\n" + _logs(out_dir, nprocs))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]


def _fork_ranks(script: Path, nprocs: int, args, out_dir: Path, env: dict, timeout: float) -> None:
    """SMP_BENCH_FORK_RANKS=1 (the tests set it, tests/distributed/test_benchmarks.py): the ranks are
    forked from a job server that imported torch, DeepSpeed and transformers once for this program
    (tests/distributed/launch_util.run_job) instead of starting as fresh processes, which on the
    2-core CI machine spend 5-6 s of CPU each on those imports. What the tests check (losses, tensor
    bytes, configs, which figures exist) does not depend on how a rank started; the figures in
    RESULTS.md come from fresh processes (the default), where start-up, RSS and timing are a user's."""
    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from launch_util import run_job

    try:
        run_job(script, nprocs, [str(a) for a in args], env=env, timeout=timeout, out_dir=out_dir)
    except AssertionError as exc:  # run_job's report: exit codes or a timeout, with every rank's log
        raise RuntimeError(str(exc)) from None


def _logs(out_dir: Path, nprocs: int) -> str:
    return "\n".join(f"--- rank {r} ---\n" + "\n".join((out_dir / f"log{r}.txt").read_text().splitlines()[-40:])
                     for r in range(nprocs))


def write_result(obj) -> None:
    out = Path(os.environ.get("BENCH_OUT", "."))
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(obj))


# -- model and data ----------------------------------------------------------------------------
def quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("DeepSpeed", "deepspeed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def build_model(seed: int = 0, **overrides):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(**{**MODEL, **overrides}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def lm_train_step(smp):
    """The benchmarks' smp step, as smp v1 scripts write it: GPT-2's loss from labels, model.backward."""

    @smp.step
    def train_step(model, input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        model.backward(loss)
        return loss

    return train_step


def deepspeed_lm_step(engine):
    """The loop a DeepSpeed user writes around ``engine``: engine(batch) / engine.backward(loss) /
    engine.step() per microbatch; returns the mean loss."""
    import torch

    gas = engine.gradient_accumulation_steps()

    def step(x):
        losses = []
        for mb in x.chunk(gas):
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        return torch.stack(losses).mean().item()

    return step


def batch(step: int, rank: int, size: int = PER_RANK_BATCH, seq: int = SEQ, vocab: int = MODEL["vocab_size"]):
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, vocab, (size, seq), generator=g)


# -- the hand-written DeepSpeed config -------------------------------------------------------------
def native_deepspeed_config(options: dict, world_size: int, backward_passes_per_step: int = 1,
                            style: str = "translated") -> dict:
    """What a DeepSpeed user writes for the same job. Pure: no process group needed.

    ``translated``: the adapter's own config (to_deepspeed_config with the real micro batch,
    backward_passes_per_step and the backend this machine runs), so the two engines differ only
    in the code around them. ``defaults``: the minimal config a DeepSpeed user writes (micro batch,
    gradient accumulation, ZeRO stage) and DeepSpeed's defaults for everything else (overlap_comm
    on for ZeRO-3, stage3_param_persistence_threshold 1e5, bucket sizes, gradient_clipping 1.0)."""
    import torch

    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.translate.deepspeed import to_deepspeed_config

    dims = ParallelDims.from_config(SMPConfig.from_sources(options, {}), world_size)
    if style == "defaults":
        return {"train_micro_batch_size_per_gpu": dims.micro_batch_size(PER_RANK_BATCH),
                "gradient_accumulation_steps": dims.cfg.microbatches * backward_passes_per_step,
                "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": dims.zero_stage}}
    return to_deepspeed_config(dims, per_rank_batch=PER_RANK_BATCH, backward_passes_per_step=backward_passes_per_step,
                               backend="nccl" if torch.cuda.is_available() else "gloo")


def config_difference(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two (nested) config dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_difference(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: adapter={va!r} native={vb!r}")
    return out


# -- measurements ------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def spread(values) -> str:
    return f"min {min(values):.3f} / median {statistics.median(values):.3f} / max {max(values):.3f}"
