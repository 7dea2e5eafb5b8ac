"""GPU throughput: a ~1B-parameter decoder in bf16 through the smp API vs hand-written DeepSpeed,
one row per setting of the kernel switches (issue 52), both sides on the same setting.

Model: a Llama-style decoder from a LlamaConfig (hidden 2048, 18 layers, 16 heads, SwiGLU 5632,
vocab 32000, untied head: ~1.06B parameters), bf16 (smp option ``bf16``), torch.optim.AdamW, SDPA
attention. Both sides use the same DeepSpeed config (smp_adapter.translate.deepspeed.to_deepspeed_config,
as the runtime's gradient_accumulation_steps) and the same data:

  adapter: smp.init, smp.DistributedModel, smp.DistributedOptimizer, @smp.step + model.backward,
           optimizer.step();
  native:  deepspeed.initialize, engine(batch) / engine.backward(loss) / engine.step() per microbatch.

A setting is four switches; each list option gives the values to try and every combination is a
setting (``--preset issue52`` is the list the device run measures):

  --compile       off | blocks[:backend]  adapter: SMP_ADAPTER_COMPILE (each decoder layer compiled on its own);
                                          native: the same torch.compile of each layer's forward, by hand
  --optimizer     plain | foreach | fused torch AdamW(foreach=False) | (foreach=True) | (fused=True), given to
                                          both sides explicitly (the adapter's own switch to fused applies
                                          only where the script chose no kernel: compat/fused_optimizers.py)
  --checkpointing off | on                adapter: smp.set_activation_checkpointing on each layer; native:
                                          transformers' gradient_checkpointing_enable (non-reentrant)
  --micro-batch   N                       rows per microbatch; per-rank batch = N x --microbatches

Per setting the two sides run as separate jobs (two 1B engines in one process would double the
memory), alternated adapter, native, native, adapter, ... for --rounds rounds. Per job: --warmup steps
(compilation happens there), then --steps timed steps (barrier + CUDA synchronize around each; a step's
time is the slowest rank's). A setting's figure is the median over its rounds.

  tokens/s = per-rank batch x sequence x data-parallel ranks / median step time
  MFU      = 6 x parameters x tokens/s / (peak bf16 FLOP/s per GPU x GPUs)
             (the usual 6N approximation: attention score FLOPs and checkpointing's recompute are not counted)

The peak comes from a table of dense bf16 tensor-core figures by GPU name, or --peak-tflops. Each row
also says which SDPA kernel ran (runtime/attention.py's recorder, on both sides: on CUDA it only observes;
its CPU rule changes only CPU attention whose kernel raises).
``--json FILE`` writes {"meta": {...}, "rows": [one per setting and side: setting, side, mfu,
tokens_per_s, step_s, peak_mem, attention, ...]}; ``--profile`` adds each job's one profiled step after
the timed ones (the top kernels by self time, and the step's time by kind: matmul, attention,
optimizer, communication, other).
Without a CUDA device it prints "no CUDA device: skipped" and exits 0.

    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py                      # all GPUs
    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py --preset issue52 --json out.json
    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py --optimizer foreach,fused --compile off,blocks
    PYTHONPATH=adapter .venv/bin/python benchmarks/gpu_throughput.py --cpu-smoke          # code check, tiny model on CPU, no MFU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import quiet, run_ranks, spread, write_result  # noqa: E402

OPTIMIZERS = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# what the device run measures (issue 52); one job of each side per setting and round
PRESETS = {
    # ordered by what matters most, since a device call may stop before the end (--stop-after): the §4 baseline
    # (torch's CUDA default, foreach), fused AdamW, + per-block compile, then larger micro-batches (new shapes:
    # inductor compiles again) and activation checkpointing at the largest
    "issue52": [dict(compile="off", optimizer="foreach", checkpointing="off", micro_batch=4),
                dict(compile="off", optimizer="fused", checkpointing="off", micro_batch=4),
                dict(compile="blocks", optimizer="fused", checkpointing="off", micro_batch=4),
                dict(compile="blocks", optimizer="fused", checkpointing="off", micro_batch=8),
                dict(compile="blocks", optimizer="fused", checkpointing="on", micro_batch=16)],
}


def setting_label(st: dict) -> str:
    return f"compile={st['compile']} opt={st['optimizer']} ac={st['checkpointing']} mb={st['micro_batch']}"


def settings_from(args) -> list[dict]:
    """The settings to measure: a preset, or every combination of the four list options."""
    if args.preset:
        return [dict(st) for st in PRESETS[args.preset]]
    lists = [v.split(",") for v in (args.compile, args.optimizer, args.checkpointing)] + \
        [[int(v) for v in args.micro_batch.split(",")]]
    out = [dict(compile=c, optimizer=o, checkpointing=a, micro_batch=m) for c, o, a, m in itertools.product(*lists)]
    for st in out:
        if st["optimizer"] not in OPTIMIZERS or st["checkpointing"] not in ("off", "on") or \
                st["compile"].split(":")[0] not in ("off", "blocks"):
            raise SystemExit(f"unknown setting {setting_label(st)}: --compile off|blocks[:backend], "
                             f"--optimizer {'|'.join(OPTIMIZERS)}, --checkpointing off|on")
    return out


def compile_backend(value: str) -> str | None:
    """None for off; the torch.compile backend for blocks[:backend] (inductor by default)."""
    mode, _, backend = value.partition(":")
    return None if mode == "off" else backend or "inductor"

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
    from smp_adapter.runtime.attention import attention_backends, record_backends

    record_backends(rank)  # observes which SDPA kernel runs (the adapter's smp.init installs it too)
    backend = compile_backend(args.compile)

    if args.role == "adapter":
        # compile: SMP_ADAPTER_COMPILE, set in this job's environment by the launcher (main)
        model = smp.DistributedModel(model)
        if args.checkpointing == "on":
            for layer in model.get_module().model.layers:
                smp.set_activation_checkpointing(layer)
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5,
                                                               **OPTIMIZERS[args.optimizer]))

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
        if args.checkpointing == "on":  # what a hand-written transformers + DeepSpeed script does
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if backend:  # each decoder layer's forward compiled on its own, as torchtitan
            for layer in model.model.layers:
                layer.forward = torch.compile(layer.forward, backend=backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **OPTIMIZERS[args.optimizer])
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

    profile = profile_step(step, torch.randint(0, cfg.vocab_size, (args.per_rank_batch, args.seq), generator=g)
                           .to(device), cuda) if args.profile else None
    write_result({"times": times, "n_params": n_params, "dp": dp, "profile": profile,
                  "attention": sorted({b for b in attention_backends().values()}),
                  "peak_mem": torch.cuda.max_memory_allocated() if cuda else
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    dist.barrier()


def profile_step(step, x, cuda: bool, top: int = 20) -> dict:
    """One more step under torch.profiler (after the timed ones, so they are not slowed): where the time
    goes when a figure falls short. The ``top`` kernels (GPU) or operators (CPU) by self time, and the
    step's time by kind (matrix products, attention, optimizer, communication, the rest)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(x)
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if cuda:  # GPU kernels only (operators' device time would count each kernel again)
        events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA] or events
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    # first match wins: communication and attention before matmul, whose "mm" is in many names
    kinds = {"communication": ("nccl", "allreduce", "all_reduce", "reduce_scatter", "allgather", "gloo"),
             "attention": ("attention", "flash", "fmha"), "optimizer": ("adam", "multi_tensor", "foreach"),
             "matmul": ("gemm", "matmul", "aten::mm", "aten::bmm", "aten::addmm", "cutlass", "xmma", "linear")}
    by_kind: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        kind = next((k for k, words in kinds.items() if any(w in name for w in words)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + getattr(e, key) / 1e3
    return {"unit": "ms (self " + ("GPU" if cuda else "CPU") + " time, one step)", "by_kind": by_kind,
            "top": [[e.key[:120], getattr(e, key) / 1e3, e.count] for e in events[:top]]}


# =============================================================================================
# launcher
# =============================================================================================
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default=None, choices=["zero0", "zero1", "zero3", "hpz"],
                   help="default: zero3 (sharded_data_parallel_degree = all GPUs) on >1 GPU, zero0 on one")
    p.add_argument("--nprocs", type=int, default=None, help="default: every visible GPU")
    p.add_argument("--compile", default="off", help="comma-separated: off, blocks, blocks:<backend>")
    p.add_argument("--optimizer", default="foreach", help="comma-separated: plain, foreach, fused")
    p.add_argument("--checkpointing", default="off", help="comma-separated: off, on")
    p.add_argument("--micro-batch", default="4", help="comma-separated rows per microbatch")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a list of settings instead of the four above")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="adapter/native job pairs per setting, order alternating")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per GPU (overrides the table)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--profile", action="store_true",
                   help="profile one more step per job (torch.profiler): the top kernels and time by kind in the rows")
    p.add_argument("--stop-after", type=float, default=None,
                   help="start no further setting after this many seconds (its rows say so); for a device call's budget")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the program on CPU with a tiny model (2 ranks, gloo); prints no MFU")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default="adapter", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--native-config", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--per-rank-batch", type=int, default=8, help=argparse.SUPPRESS)  # the worker's, from the setting
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: skipped")
        return 0
    settings = settings_from(args)
    if args.cpu_smoke:
        args.seq = min(args.seq, 64)
        args.steps, args.warmup, args.rounds = min(args.steps, 3), min(args.warmup, 1), min(args.rounds, 1)
        for st in settings:
            st["micro_batch"] = min(st["micro_batch"], 2)
    nprocs = args.nprocs or (torch.cuda.device_count() if cuda else 2)
    mode = args.mode or ("zero3" if nprocs > 1 else "zero0")
    options = smp_options(mode, nprocs, args.microbatches)
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU (smoke test, not a GPU measurement)"
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    print(f"# {device_name} x {nprocs}, torch {torch.__version__}, mode {mode}, smp options {options}")
    print(f"# seq {args.seq}, microbatches {args.microbatches}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.rounds} round(s) per setting; peak "
          f"{f'{peak:.1f} TFLOP/s per GPU' if peak else 'unknown (pass --peak-tflops for MFU)'}", flush=True)
    out_root = Path(tempfile.mkdtemp(prefix="smp_gpu_tput_"))
    import platform

    meta = {"device": device_name, "nprocs": nprocs, "mode": mode, "smp_options": options, "seq": args.seq,
            "microbatches": args.microbatches, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
            "peak_tflops": peak, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "model": "smoke" if args.cpu_smoke else "llama-1.06B",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rows: list[dict] = []
    started = time.time()
    for k, st in enumerate(settings):
        if args.stop_after and time.time() - started > args.stop_after:
            print(f"{setting_label(st):44s} | not started: --stop-after {args.stop_after:.0f} s passed", flush=True)
            rows += [{"setting": setting_label(st), "side": side, "mfu": None, "tokens_per_s": None,
                      "error": "not started (--stop-after)", **st} for side in ("adapter", "native")]
            continue
        rows += measure_setting(args, k, st, nprocs, options, peak, cuda, out_root)
        if args.json:  # after every setting: a run stopped by its time limit keeps what it measured
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    done = [(a, b) for a, b in zip(rows[::2], rows[1::2]) if a["tokens_per_s"] and b["tokens_per_s"]]
    if done:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in done]
        best = max((a for a, _ in done), key=lambda r: r["tokens_per_s"])
        print(f"tokens/s adapter/native over {len(ratios)} setting(s): {spread(ratios)}  (>= 0.98 meets the target)")
        print(f"best adapter setting: {best['setting']}: {best['tokens_per_s']:.0f} tokens/s"
              + (f", MFU {best['mfu'] * 100:.1f}%" if best["mfu"] is not None else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if len(done) == len(settings) else 1


def measure_setting(args, k: int, st: dict, nprocs: int, options: dict, peak, cuda: bool, out_root: Path) -> list[dict]:
    """The two rows of one setting (adapter, native). A job that fails (out of memory at a large micro-batch)
    gives rows with its error instead, and the other side is not run: the setting has no comparison."""
    per_rank_batch = st["micro_batch"] * args.microbatches
    ds_config = native_config(options, nprocs, per_rank_batch)
    runs = {"adapter": [], "native": []}
    base = {"setting": setting_label(st), **st, "per_rank_batch": per_rank_batch, "mfu": None, "tokens_per_s": None}
    for rnd in range(args.rounds):
        for role in (("adapter", "native") if rnd % 2 == 0 else ("native", "adapter")):
            wargs = ["--worker", "--role", role, "--options", json.dumps(options),
                     "--native-config", json.dumps(ds_config), "--per-rank-batch", per_rank_batch,
                     "--seq", args.seq, "--warmup", args.warmup, "--steps", args.steps, "--compile", st["compile"],
                     "--optimizer", st["optimizer"], "--checkpointing", st["checkpointing"]] + \
                (["--cpu-smoke"] if args.cpu_smoke else []) + (["--profile"] if args.profile else [])
            env = {"SMP_ADAPTER_COMPILE": st["compile"]} if role == "adapter" else {}
            try:
                res = run_ranks(Path(__file__).resolve(), nprocs, wargs, out_root / f"{k}_{role}_{rnd}", env=env,
                                timeout=args.timeout)
            except Exception as exc:  # noqa: BLE001  (a rank's failure, its log's tail in the message)
                error = f"{role} job failed: {str(exc)[-800:]}"
                said = [ln for ln in str(exc).splitlines() if "Error" in ln or "error" in ln] or [str(exc)]
                print(f"{setting_label(st):44s} | {role} job failed: {said[-1].strip()[:200]} (rows keep the log's tail)",
                      flush=True)
                return [{**base, "side": side, "error": error} for side in ("adapter", "native")]
            runs[role].append((statistics.median(max(r["times"][j] for r in res) for j in range(args.steps)), res))
    rows, line = [], []
    for role in ("adapter", "native"):
        step_s = statistics.median(t for t, _ in runs[role])
        res = runs[role][0][1]
        tps = per_rank_batch * args.seq * res[0]["dp"] / step_s
        n = res[0]["n_params"]
        mfu = 6 * n * tps / (peak * 1e12 * nprocs) if peak else None
        mem = max(r["peak_mem"] for _, rs in runs[role] for r in rs)
        rows.append({**base, "side": role, "mfu": mfu, "tokens_per_s": tps, "step_s": step_s,
                     "step_s_rounds": [t for t, _ in runs[role]], "peak_mem": mem, "n_params": n,
                     "attention": res[0]["attention"], "profile": res[0].get("profile")})
        line.append(f"{role} {tps:9.0f} tok/s MFU {f'{mfu * 100:5.1f}%' if mfu is not None else '  n/a'} "
                    f"{'mem' if cuda else 'RSS'} {mem / 2**30:6.2f} GiB")
    print(f"{setting_label(st):44s} | {line[0]} | {line[1]} | adapter/native "
          f"{rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.3f} | attention "
          f"{','.join(rows[0]['attention']) or '- (inside compiled graphs)'}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
