"""Adapter overhead: the smp API on DeepSpeed vs the same job written by hand for DeepSpeed.

The same GPT-2-style model (same initial weights), the same data, torch.optim.AdamW, the same
per-rank batch and microbatches, run

  A (adapter): smp.init, smp.DistributedModel, smp.DistributedOptimizer, an @smp.step function
               with model.backward, optimizer.step() after it (and optimizer.zero_grad() before);
  B (native):  deepspeed.initialize on a deep copy of the model with the equivalent config (the
               adapter's own, smp_adapter.translate.deepspeed.to_deepspeed_config; or with
               --native defaults the minimal config a DeepSpeed user writes, DeepSpeed's defaults
               for the rest), and the loop a DeepSpeed user writes: engine(batch) /
               engine.backward(loss) / engine.step() per microbatch.

Modes: zero0, zero1, zero3, hpz (the default run; GPT-2 n_embd 128 x 2 layers) and zero3_big
(GPT-2 n_embd 256 x 4 layers, seq 128, smp's sdp defaults, 2 ranks), the issue's bigger size.

Step time: both engines live in the same processes and process group; steps alternate
A B B A A B ... (the order flips every pair so neither engine always runs first). Each timed step
starts after a barrier. A step's wall time is the slowest rank's; its CPU time the sum over ranks
of process CPU time (less sensitive to other jobs on a shared machine). Per repeat: the ratio of
the engines' median step times, and the median of the per-pair ratios A_i / B_i (A and B of a pair
ran back to back, under the same load). The spread of each over repeats is printed. The headline
figure, checked against the target (<= 1.02), is the median of the pair ratios A_i / B_i of all
repeats pooled: pairing cancels the load drift of a shared machine, pooling the repeat-to-repeat
scatter. The engines
train identical replicas on identical batches: their losses are compared (and, when memory jobs
run too, with single-engine runs, to show the two engines in one process do not disturb each
other). The engine configs are compared key by key.

Memory: peak RSS per rank (CPU) or peak allocated CUDA memory (GPU), from separate short jobs that
build only one of the two (peak RSS is per process). The native-only job never imports smp_adapter.

Noise: --control replaces the adapter by a second hand-written engine (an A/A run), so the spread
it prints is the machine's noise floor. --profile N runs N more steps per engine under cProfile
and prints the adapter's own Python time and the largest per-function differences.

    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py                  # every mode, ~5 min on 2 cores
    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py --control        # A/A noise floor
    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py --no-memory --steps 5 --repeats 1 --profile 30
    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py --no-timing --memory-repeats 3
    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py --modes zero3_big --native defaults --no-memory
    PYTHONPATH=adapter .venv/bin/python benchmarks/overhead.py --modes zero3_big --native defaults --no-memory \
        --adapter-override zero_optimization.overlap_comm=true   # one setting at a time
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (DEFAULT_MODES, LR, MICROBATCHES, MODE_MODEL, MODEL, MODES, PER_RANK_BATCH, SEQ, batch, lm_train_step,  # noqa: E402
                     build_model, deepspeed_lm_step,
                     config_difference, current_rss_bytes, native_deepspeed_config, peak_rss_bytes, quiet,
                     run_ranks, spread, write_result)
from _profile import print_profile, profile_steps  # noqa: E402

TARGET = 1.02
ENGINES = ("adapter", "native")


# =============================================================================================
# worker (one rank)
# =============================================================================================
def worker(args) -> None:
    quiet()
    import torch
    import torch.distributed as dist

    options = json.loads(args.options)
    native_cfg = json.loads(args.native_config)
    role = args.role
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    # --control: an A/A run, the "adapter" slot holds a second hand-written DeepSpeed engine
    use_smp = role in ("both", "adapter") and not args.control
    if use_smp:
        import smdistributed.modelparallel.torch as smp

        smp.init(options)
        device = torch.device("cuda", smp.local_rank()) if cuda else torch.device("cpu")
    else:  # the process group as a DeepSpeed script starts it
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False, verbose=False)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
    import deepspeed  # noqa: F811
    import transformers  # noqa: F401

    quiet()
    rss_after_imports = current_rss_bytes()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    model = build_model(**json.loads(args.model))
    # the hand-written job sizes ZeRO-3's buffers for its model as the adapter does (bounded by the
    # largest parameter where DeepSpeed's defaults are larger: translate/deepspeed.bounded_zero3_buffers),
    # so the two run one config and what is compared is the adapter's own cost
    from smp_adapter.config.options import SMPConfig
    from smp_adapter.translate.deepspeed import bounded_zero3_buffers

    native_cfg, _ = bounded_zero3_buffers(native_cfg, SMPConfig.from_dict(options),
                                          max(p.numel() for p in model.parameters()))
    if args.adapter_override and use_smp:  # experiments: change entries of the adapter's DeepSpeed config
        import smp_adapter.translate.deepspeed as translation

        overrides = dict(kv.split("=", 1) for kv in args.adapter_override)
        translate_config = translation.to_deepspeed_config

        def overridden(*a, **kw):
            config = translate_config(*a, **kw)
            for path, value in overrides.items():
                *parents, leaf = path.split(".")
                node = config
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = json.loads(value)
            return config

        translation.to_deepspeed_config = overridden
    steps = {}
    if role == "both":
        # same initial weights; both engines get a deep copy, so neither keeps the tensors that
        # were allocated piecemeal while the model was built (memory placement affects CPU speed)
        native_model, model = copy.deepcopy(model), copy.deepcopy(model)
    else:
        native_model = model

    def native_engine(module):
        """B: hand-written DeepSpeed, as a DeepSpeed user writes the loop."""
        module.to(device)
        engine, _, _, _ = deepspeed.initialize(model=module, config=native_cfg, dist_init_required=False,
                                               optimizer=torch.optim.AdamW(module.parameters(), lr=LR))
        return deepspeed_lm_step(engine), engine.config

    # -- A: the smp API ------------------------------------------------------------------------
    if use_smp:
        smp_model = smp.DistributedModel(model)
        smp_opt = smp.DistributedOptimizer(torch.optim.AdamW(smp_model.parameters(), lr=LR))
        train_step = lm_train_step(smp)

        def adapter_step(x):
            smp_opt.zero_grad()
            loss_mb = train_step(smp_model, x)
            smp_opt.step()
            return loss_mb.reduce_mean().item()

        steps["adapter"] = adapter_step
        adapter_cfg = smp_model.engine.config
    elif role in ("both", "adapter"):
        steps["adapter"], adapter_cfg = native_engine(model)

    # -- B: hand-written DeepSpeed ---------------------------------------------------------------
    if role in ("both", "native"):
        steps["native"], _ = native_engine(native_model)

    def timed(name, step_index):
        x = batch(step_index, rank).to(device)
        dist.barrier()
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = steps[name](x)
        sync()
        return (time.perf_counter() - t0, time.process_time() - c0), loss

    result = {"role": role, "rank": rank}
    if role == "both":
        result["config_difference"] = config_difference(adapter_cfg, native_cfg)
        # times[engine][repeat] = [(wall s, this process's CPU s) per measured step]
        times = {"adapter": [[] for _ in range(args.repeats)], "native": [[] for _ in range(args.repeats)]}
        losses = {"adapter": [], "native": []}
        s = 0
        for _ in range(args.warmup):
            for name in ("adapter", "native"):
                losses[name].append(timed(name, s)[1])
            s += 1
        for rep in range(args.repeats):
            for j in range(args.steps):
                order = ("adapter", "native") if (rep * args.steps + j) % 2 == 0 else ("native", "adapter")
                for name in order:
                    dt, loss = timed(name, s)
                    times[name][rep].append(dt)
                    losses[name].append(loss)
                s += 1
        if args.profile:  # attribution: a fresh cProfile around every step of each engine
            result["profile"] = profile_steps(steps, lambda i: batch(i, rank).to(device), s, args.profile, dist)
        result.update(times=times, losses=losses)
    else:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses = [timed(role, s)[1] for s in range(args.warmup + args.steps)]
        result.update(losses=losses, peak_rss=peak_rss_bytes(), rss_after_imports=rss_after_imports,
                      cuda_peak_allocated=torch.cuda.max_memory_allocated() if cuda else None)
    write_result(result)
    dist.barrier()


# =============================================================================================
# launcher
# =============================================================================================
def _job(mode, role, args, out_root, tag=""):
    options, nprocs, _ = MODES[mode]
    native_cfg = native_deepspeed_config(options, nprocs, style=args.native)
    wargs = ["--worker", "--role", role, "--options", json.dumps(options), "--native-config", json.dumps(native_cfg),
             "--model", json.dumps(MODE_MODEL.get(mode, {})),
             *[a for kv in args.adapter_override for a in ("--adapter-override", kv)],
             "--warmup", args.warmup if role == "both" else 0,
             "--steps", args.steps if role == "both" else args.memory_steps,
             "--repeats", args.repeats, *(["--control"] if args.control else []), "--profile", args.profile if role == "both" else 0]
    env = dict(kv.split("=", 1) for kv in args.env)
    return run_ranks(Path(__file__).resolve(), nprocs, wargs, out_root / f"{mode}_{role}{tag}", env=env, timeout=args.timeout)


def timing(mode, args, out_root) -> dict:
    results = _job(mode, "both", args, out_root)
    r0 = results[0]
    out = {"median_adapter_s": [], "median_native_s": [], "ratio_of_medians": [], "paired_wall": [],
           "paired_cpu": [], "cpu_adapter_s": [], "cpu_native_s": [], "pair_wall": [], "pair_cpu": []}
    for rep in range(args.repeats):
        # a step's wall time is the slowest rank's; its CPU time the sum over ranks
        wall = {n: [max(r["times"][n][rep][j][0] for r in results) for j in range(args.steps)] for n in ENGINES}
        cpu = {n: [sum(r["times"][n][rep][j][1] for r in results) for j in range(args.steps)] for n in ENGINES}
        a, b = statistics.median(wall["adapter"]), statistics.median(wall["native"])
        out["median_adapter_s"].append(a)
        out["median_native_s"].append(b)
        out["ratio_of_medians"].append(a / b)
        # A and B of one pair ran back to back, so they shared the machine's load at that moment
        out["paired_wall"].append(statistics.median(x / y for x, y in zip(wall["adapter"], wall["native"])))
        out["paired_cpu"].append(statistics.median(x / y for x, y in zip(cpu["adapter"], cpu["native"])))
        out["pair_wall"] += [x / y for x, y in zip(wall["adapter"], wall["native"])]
        out["pair_cpu"] += [x / y for x, y in zip(cpu["adapter"], cpu["native"])]
        out["cpu_adapter_s"].append(statistics.median(cpu["adapter"]))
        out["cpu_native_s"].append(statistics.median(cpu["native"]))
    la, ln = r0["losses"]["adapter"], r0["losses"]["native"]
    out.update(max_rel_loss_diff=max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, ln)),
               first_loss=la[0], last_loss=la[-1], config_difference=r0["config_difference"],
               profile=r0.get("profile"), losses_rank0=r0["losses"])
    return out


def print_timing(label, nprocs, t, names) -> None:
    A, B = names
    print(f"[{label}, {nprocs} processes] step time (wall: slowest rank; CPU: sum over ranks)")
    for rep in range(len(t["paired_wall"])):
        print(f"  repeat {rep}: wall median {A} {t['median_adapter_s'][rep] * 1e3:6.1f} ms  "
              f"{B} {t['median_native_s'][rep] * 1e3:6.1f} ms  ratio {t['ratio_of_medians'][rep]:.3f}  "
              f"paired {t['paired_wall'][rep]:.3f} | CPU {A} {t['cpu_adapter_s'][rep] * 1e3:6.1f} ms  "
              f"{B} {t['cpu_native_s'][rep] * 1e3:6.1f} ms  paired {t['paired_cpu'][rep]:.3f}")
    for key, what in (("ratio_of_medians", "wall, ratio of medians"), ("paired_wall", "wall, median paired ratio"),
                      ("paired_cpu", "CPU, median paired ratio")):
        print(f"  {A}/{B} ({what}) over repeats: {spread(t[key])}")
    # the headline: every back-to-back pair of every repeat, pooled (pairs share the machine's load)
    ratio, cpu = statistics.median(t["pair_wall"]), statistics.median(t["pair_cpu"])
    verdict = "OK" if ratio <= TARGET else "ABOVE TARGET"
    print(f"  ==> {A}/{B} step time {ratio:.3f} (wall; median of all {len(t['pair_wall'])} back-to-back pairs), "
          f"CPU {cpu:.3f}; spread over repeats {min(t['paired_wall']):.3f}-{max(t['paired_wall']):.3f}   "
          f"{verdict} (target <= {TARGET})")
    print(f"  losses {A} vs {B}: max relative difference {t['max_rel_loss_diff']:.1e} "
          f"(loss {t['first_loss']:.3f} -> {t['last_loss']:.3f})")
    print(f"  engine config difference: {t['config_difference'] or 'none'}")


def memory(mode, args, out_root) -> dict:
    """Adapter-only and native-only jobs; on CPU the two of a pair run at the same time (peak RSS
    does not depend on speed), on a GPU one after the other."""
    import torch

    pairs = []
    for rep in range(args.memory_repeats):
        if torch.cuda.is_available():
            pairs.append((_job(mode, "adapter", args, out_root, f"_{rep}"), _job(mode, "native", args, out_root, f"_{rep}")))
            continue
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(_job, mode, "adapter", args, out_root, f"_{rep}")
            fn = pool.submit(_job, mode, "native", args, out_root, f"_{rep}")
            pairs.append((fa.result(), fn.result()))
    key = "cuda_peak_allocated" if pairs[0][0][0]["cuda_peak_allocated"] is not None else "peak_rss"
    return {"metric": key,
            "adapter": [[r[key] for r in ra] for ra, _ in pairs], "native": [[r[key] for r in rn] for _, rn in pairs],
            "adapter_base": [[r["rss_after_imports"] for r in ra] for ra, _ in pairs],
            "native_base": [[r["rss_after_imports"] for r in rn] for _, rn in pairs],
            "losses": {"adapter": pairs[0][0][0]["losses"], "native": pairs[0][1][0]["losses"]}}


def print_memory(label, m, names) -> None:
    unit = "peak allocated CUDA memory" if m["metric"] == "cuda_peak_allocated" else "peak RSS"
    reps = len(m["adapter"])
    print(f"[{label}] {unit} per rank (separate {names[0]}-only / {names[1]}-only jobs, {reps} pair(s))")
    ratios = []
    for rep in range(reps):
        for r, (a, b) in enumerate(zip(m["adapter"][rep], m["native"][rep])):
            ratios.append(a / b)
            extra = ""
            if m["metric"] == "peak_rss":
                extra = (f"  (after imports: {m['adapter_base'][rep][r] / 2**20:.0f} / "
                         f"{m['native_base'][rep][r] / 2**20:.0f} MiB)")
            print(f"  pair {rep} rank {r}: {names[0]} {a / 2**20:8.1f} MiB  {names[1]} {b / 2**20:8.1f} MiB  "
                  f"ratio {a / b:.3f}{extra}")
    print(f"  ratio {names[0]}/{names[1]} over ranks and pairs: {spread(ratios)}"
          f"   {'OK' if statistics.median(ratios) <= TARGET else 'ABOVE TARGET'} (median; target <= {TARGET})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--native", choices=("translated", "defaults"), default="translated",
                   help="the hand-written engine's config: the adapter's translation (default), or DeepSpeed's own "
                        "defaults with only micro batch, gradient accumulation and ZeRO stage set")
    p.add_argument("--adapter-override", action="append", default=[], metavar="PATH=JSON",
                   help="experiments: set an entry of the adapter's DeepSpeed config, e.g. "
                        "zero_optimization.overlap_comm=true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="measured steps per engine per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-steps", type=int, default=4,
                   help="steps of the memory jobs (peak RSS is reached in the first step, when Adam's state appears)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--timeout", type=float, default=280)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, run N more steps per engine under cProfile and print where the "
                        "time difference goes")
    p.add_argument("--control", action="store_true",
                   help="A/A noise floor: the adapter's place is taken by a second hand-written DeepSpeed engine")
    p.add_argument("--memory-repeats", type=int, default=1, help="adapter-only/native-only job pairs per mode")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every rank (experiments, e.g. LOCAL_SIZE=2)")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", default="both", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--native-config", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--model", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; choose from {list(MODES)}")
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"# adapter overhead: GPT-2 {MODEL} (zero3_big: {MODE_MODEL['zero3_big']}), seq {SEQ}, per-rank batch "
          f"{PER_RANK_BATCH}, microbatches {MICROBATCHES}, AdamW, fp32, {dev}, torch {torch.__version__}; "
          f"native config: {args.native}" + (f"; adapter overrides {args.adapter_override}" if args.adapter_override else ""))
    print(f"# {args.warmup} warm-up + {args.steps} measured steps per engine, x{args.repeats} repeats, "
          f"A/B alternating in one process group\n")
    names = ("native#2", "native") if args.control else ("adapter", "native")
    if args.control:
        print("# CONTROL (A/A): both engines are hand-written DeepSpeed; the ratios show the noise floor\n")
    out_root = Path(tempfile.mkdtemp(prefix="smp_overhead_"))
    figures = {}
    started = time.time()
    for mode in modes:
        label = MODES[mode][2]
        figures[mode] = {}
        if not args.no_timing:
            t = timing(mode, args, out_root)
            figures[mode]["timing"] = t
            print_timing(label, MODES[mode][1], t, names)
            if args.profile:
                print_profile(t["profile"], ENGINES)
        if not args.no_memory:
            m = memory(mode, args, out_root)
            figures[mode]["memory"] = m
            print_memory(label, m, names)
            if "timing" in figures[mode]:  # did the second engine in the process change the first one's training?
                t = figures[mode]["timing"]
                diffs = [abs(x - y) / abs(y) for name in ENGINES
                         for x, y in zip(m["losses"][name], t["losses_rank0"][name])]
                print(f"  single-engine jobs vs the two-engine job, rank 0 losses of the first {len(m['losses']['adapter'])} "
                      f"steps: max relative difference {max(diffs):.1e}")
        print(flush=True)
    print(f"# summary: {names[0]}/{names[1]}. Step time: median of all back-to-back pairs (the target, <= {TARGET}), "
          f"then min / median / max over repeats; memory: over ranks and pairs")
    print(f"| mode | step time, all pairs | wall, paired | wall, ratio of medians | CPU, paired | "
          f"{'peak CUDA alloc' if torch.cuda.is_available() else 'peak RSS'} |")
    print("| --- | --- | --- | --- | --- | --- |")
    fmt = lambda v: f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}" if v else "-"  # noqa: E731
    for mode, f in figures.items():
        t, m = f.get("timing", {}), f.get("memory")
        mem = [a / b for ra, rb in zip(m["adapter"], m["native"]) for a, b in zip(ra, rb)] if m else []
        pooled = f"{statistics.median(t['pair_wall']):.3f}" if t else "-"
        print(f"| {MODES[mode][2]} | {pooled} | {fmt(t.get('paired_wall', []))} | {fmt(t.get('ratio_of_medians', []))} | "
              f"{fmt(t.get('paired_cpu', []))} | {fmt(mem)} |")
    print(f"\n# total wall time {time.time() - started:.0f} s; rank logs under {out_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
