"""GPU throughput: a ~1B-parameter decoder in bf16 through the smp API vs hand-written DeepSpeed.

Model: a Llama-style decoder from a LlamaConfig (hidden 2048, 18 layers, 16 heads, SwiGLU 5632,
vocab 32000, untied head: ~1.06B parameters), bf16 (smp option ``bf16``), torch.optim.AdamW.
Both sides use the same DeepSpeed config (smp_adapter.translate.deepspeed.to_deepspeed_config, as
the runtime's gradient_accumulation_steps) and the same data:

  adapter: smp.init, smp.DistributedModel, smp.DistributedOptimizer, @smp.step + model.backward,
           optimizer.step();
  native:  deepspeed.initialize, engine(batch) / engine.backward(loss) / engine.step() per microbatch.

The two run as separate jobs (two 1B engines in one process would double the memory), alternated
adapter, native, native, adapter, ... for --rounds rounds. Per job: --warmup steps, then --steps timed
steps (barrier + CUDA synchronize around each; a step's time is the slowest rank's).

  tokens/s = per-rank batch x sequence x data-parallel ranks / median step time
  MFU      = 6 x parameters x tokens/s / (peak bf16 FLOP/s per GPU x GPUs)
             (the usual 6N approximation: attention score FLOPs are not counted)

The peak comes from a table of dense bf16 tensor-core figures by GPU name, or --peak-tflops.
Without a CUDA device it prints "no CUDA device: skipped" and exits 0.

    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py                      # all GPUs
    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py --mode zero3 --nprocs 8
    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py --cpu-smoke          # code check, tiny model on CPU, no MFU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import quiet, run_ranks, spread, write_result  # noqa: E402

# dense (no sparsity) bf16 tensor-core peak, TFLOP/s per GPU; first matching substring wins
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
]

MODEL_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=18, num_attention_heads=16,
                num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
MODEL_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value
    return None


def smp_options(mode: str, nprocs: int, microbatches: int) -> dict:
    base = {"ddp": True, "bf16": True, "microbatches": microbatches}
    if mode == "zero0":
        return base
    if mode == "zero1":
        return {**base, "shard_optimizer_state": True}
    if mode == "zero3":
        return {**base, "sharded_data_parallel_degree": nprocs}
    if mode == "hpz":
        if nprocs < 4 or nprocs % 2:
            raise SystemExit(f"--mode hpz needs an even number of processes >= 4, got {nprocs}")
        return {**base, "sharded_data_parallel_degree": nprocs // 2}
    raise SystemExit(f"unknown --mode {mode}")


def native_config(options: dict, nprocs: int, per_rank_batch: int) -> dict:
    import torch

    from smp_adapter.config.dims import ParallelDims
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.translate.deepspeed import to_deepspeed_config

    dims = ParallelDims.from_config(SMPConfig.from_sources(options, {}), nprocs)
    # the runtime's own config: backward_passes_per_step 1, the backend the job runs on
    return to_deepspeed_config(dims, per_rank_batch=per_rank_batch,
                               backend="nccl" if torch.cuda.is_available() else "gloo")


# =============================================================================================
# worker
# =============================================================================================
def worker(args) -> None:
    quiet()
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    options = json.loads(args.options)
    if args.role == "adapter":
        import smdistributed.modelparallel.torch as smp

        smp.init(options)
        device = torch.device("cuda", smp.local_rank()) if cuda else torch.device("cpu")
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
    import deepspeed  # noqa: F811
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet()
    rank = int(os.environ["RANK"])
    cfg = LlamaConfig(**(MODEL_SMOKE if args.cpu_smoke else MODEL_1B), attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: much faster than on the host
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    if args.role == "adapter":
        model = smp.DistributedModel(model)
        optimizer = smp.DistributedOptimizer(optimizer)

        @smp.step
        def train_step(model, input_ids):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            model.backward(loss)
            return loss

        def step(x):
            optimizer.zero_grad()
            train_step(model, x)
            optimizer.step()

        dp = smp.dp_size()
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False,
                                               config=json.loads(args.native_config))
        gas = engine.gradient_accumulation_steps()

        def step(x):
            for mb in x.chunk(gas):
                loss = engine(input_ids=mb, labels=mb).loss
                engine.backward(loss)
                engine.step()

        dp = dist.get_world_size()

    g = torch.Generator().manual_seed(rank)
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.per_rank_batch, args.seq), generator=g).to(device)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    import resource

    write_result({"times": times, "n_params": n_params, "dp": dp,
                  "peak_mem": torch.cuda.max_memory_allocated() if cuda else
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    dist.barrier()


# =============================================================================================
# launcher
# =============================================================================================
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default=None, choices=["zero0", "zero1", "zero3", "hpz"],
                   help="default: zero3 (sharded_data_parallel_degree = all GPUs) on >1 GPU, zero0 on one")
    p.add_argument("--nprocs", type=int, default=None, help="default: every visible GPU")
    p.add_argument("--per-rank-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="adapter/native job pairs, order alternating")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per GPU (overrides the table)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the program on CPU with a tiny model (2 ranks, gloo); prints no MFU")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default="adapter", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--native-config", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: skipped")
        return 0
    if args.cpu_smoke:
        args.seq, args.per_rank_batch = min(args.seq, 64), min(args.per_rank_batch, 4)
        args.steps, args.warmup, args.rounds = min(args.steps, 3), min(args.warmup, 1), min(args.rounds, 1)
    nprocs = args.nprocs or (torch.cuda.device_count() if cuda else 2)
    mode = args.mode or ("zero3" if nprocs > 1 else "zero0")
    options = smp_options(mode, nprocs, args.microbatches)
    ds_config = native_config(options, nprocs, args.per_rank_batch)
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU (smoke test, not a GPU measurement)"
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    print(f"# {device_name} x {nprocs}, mode {mode}, smp options {options}")
    print(f"# per-rank batch {args.per_rank_batch} x seq {args.seq}, microbatches {args.microbatches}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} round(s); peak "
          f"{f'{peak:.1f} TFLOP/s per GPU' if peak else 'unknown (pass --peak-tflops for MFU)'}")
    out_root = Path(tempfile.mkdtemp(prefix="smp_gpu_tput_"))
    rows = {"adapter": [], "native": []}
    for rnd in range(args.rounds):
        for role in (("adapter", "native") if rnd % 2 == 0 else ("native", "adapter")):
            wargs = ["--worker", "--role", role, "--options", json.dumps(options), "--native-config", json.dumps(ds_config),
                     "--per-rank-batch", args.per_rank_batch, "--seq", args.seq, "--warmup", args.warmup,
                     "--steps", args.steps] + (["--cpu-smoke"] if args.cpu_smoke else [])
            res = run_ranks(Path(__file__).resolve(), nprocs, wargs, out_root / f"{role}_{rnd}", timeout=args.timeout)
            step_s = statistics.median(max(r["times"][j] for r in res) for j in range(args.steps))
            tokens = args.per_rank_batch * args.seq * res[0]["dp"]
            tps = tokens / step_s
            n = res[0]["n_params"]
            mfu = 6 * n * tps / (peak * 1e12 * nprocs) if peak else None
            mem = max(r["peak_mem"] for r in res)
            rows[role].append({"step_s": step_s, "tokens_per_s": tps, "mfu": mfu, "peak_mem": mem, "n_params": n})
            print(f"  round {rnd} {role:7s}: step {step_s * 1e3:8.1f} ms  {tps:10.0f} tokens/s  "
                  f"MFU {f'{mfu * 100:5.1f}%' if mfu is not None else '  n/a'}  "
                  f"peak {'allocated' if cuda else 'RSS'} {mem / 2**30:6.2f} GiB  ({n / 1e9:.2f}B parameters)", flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rows["adapter"], rows["native"])]
    mem_ratios = [a["peak_mem"] / b["peak_mem"] for a, b in zip(rows["adapter"], rows["native"])]
    print(f"tokens/s adapter/native: {spread(ratios)}  (>= 0.98 meets the target)")
    print(f"peak memory adapter/native: {spread(mem_ratios)}  (<= 1.02 meets the target)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
