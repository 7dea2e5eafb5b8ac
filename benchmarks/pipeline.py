"""Pipeline efficiency: smp's pipeline schedules against each other, against the pipeline ideal and
against DeepSpeed's own pipeline engine running the same job.

Job: a model from benchmarks/_pipeline_models.py (``--model gpt``, the default: GPT-2-style
transformer blocks, cross entropy over every token; ``--model mlp``: Linear + tanh layers, NLL),
SGD, batch ``--batch`` per step (data parallel degree 1: every rank is one pipeline rank). Swept
over pp in ``--pp`` (default 2,4), microbatches in ``--microbatches`` (default 4,8,16) and smp
schedules in ``--schedule`` (comma-separated, or ``all``); one job of pp processes (one CPU thread
each, OMP_NUM_THREADS=1) per (pp, m, schedule), ``--rounds`` times, the schedules of each (pp, m)
one right after the other in rotating order, so the summary compares each schedule with the 1F1B
job (``interleaved``) of the same round.

Three things run in each job, in the same processes, on the same data, in rotating order every step
(so drift on a shared machine hits all three):
  smp        @smp.step (forward + backward of every microbatch through all stages, under the
             job's schedule) + optimizer.step();
  DeepSpeed  the same model written as a ``deepspeed.pipe.PipelineModule`` layer list (what a user
             rewriting the script by hand for DeepSpeed would do), ``engine.train_batch()`` with
             gradient_accumulation_steps = m (DeepSpeed's TrainSchedule, also 1F1B, optimizer step
             included), same initial weights;
  stage      each rank runs *its own stage's layers* as a plain module, forward + backward of the
             same m microbatches, no communication, all ranks at once (same CPU contention as the
             pipeline): t_s = the slowest rank's time.
Each timed call starts after a barrier; its time is the slowest rank's. Medians over ``--steps``.

  ideal      = (m + p - 1) / m x t_s     (fill and drain bubble: p - 1 microbatch slots)
  no overlap = p x t_s                   (stages one after the other)

Also per rank: the measured idle fraction of the smp schedule (the engine's own clock,
runtime/engines/pipeline/idle_time.py) next to the schedule's predicted bubble fraction, and the peak
bytes of activations held for backward during an smp step (``SavedActivations``, in one untimed step
after the timed ones: its hooks would slow the smp side).

Both engines must train the same model: their stage assignments are printed and compared, and the
per-step losses of the two engines (same weights, same batches, same SGD) are compared.

Machine note: pp 4 on a 2-core machine runs 4 single-threaded ranks on 2 cores. t_s is measured
with all 4 ranks busy, as in the pipeline's steady state; during fill and drain fewer ranks are busy
and run faster than t_s / m per microbatch, so measured/ideal can fall below 1 there.

    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py --pp 2 --schedule all --rounds 2   # RESULTS §11.4
    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py --pp 2 --microbatches 8 --steps 10
    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py --model mlp --pp 2 --schedule zero_bubble  # §11-11.3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pipeline_models as models  # noqa: E402
from _common import quiet, run_ranks, write_result  # noqa: E402

LR = 1e-3
ENGINES = ("smp", "deepspeed", "stage")


def deepspeed_engine(model, args):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    import _pipeline_models as models

    # the same cuts as smp's auto-partition where it cuts at the chain's modules (printed and compared)
    module = PipelineModule(layers=models.layer_list(model, args.model, args.layers), num_stages=args.pp,
                            loss_fn=lambda out, target: models.loss(args.model, out, target),
                            partition_method="parameters", activation_checkpoint_interval=0)
    m = args.microbatches
    # batch arithmetic: train_batch_size (batch) = micro batch (batch / m) x gradient_accumulation_steps (m) x dp (1)
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch // m,
              "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False}
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine, module


def worker(args) -> None:
    quiet()
    import torch
    import torch.distributed as dist

    import _pipeline_models as models
    import smdistributed.modelparallel.torch as smp

    pp, m = args.pp, args.microbatches
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "ddp": True, "pipeline": args.schedule})
    quiet()
    full = models.build(args.model, args.width, args.layers, args.seq, args.vocab)
    ds_engine, ds_module = deepspeed_engine(full, args)
    model = smp.DistributedModel(full)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, data, target):
        loss = models.loss(args.model, model(data), target)
        model.backward(loss)
        return loss

    batches = models.batches(args.model, args.batch, args.width, args.seq, args.vocab)
    losses = {"smp": [], "deepspeed": []}
    counter = {"smp": 0, "deepspeed": 0}
    held = SavedActivations(full.parameters())

    def smp_step(count_held: bool = False):
        data, target = batches[counter["smp"] % len(batches)]
        counter["smp"] += 1
        optimizer.zero_grad()
        held.skip(data)
        # the counting hooks run per saved tensor (~12 ms of a 250 ms GPT-style step): only in the
        # untimed step after the timed ones, never in a step compared with DeepSpeed's
        with held if count_held else contextlib.nullcontext():
            losses["smp"].append(float(train_step(model, data, target).reduce_mean()))
        optimizer.step()

    def deepspeed_step():
        data, target = batches[counter["deepspeed"] % len(batches)]
        counter["deepspeed"] += 1
        microbatches = iter(zip(data.chunk(m), target.chunk(m)))
        losses["deepspeed"].append(float(ds_engine.train_batch(data_iter=microbatches)))

    # the first smp step partitions the model; after it, this rank's chain modules are known. Both
    # engines take one step here so that they go on seeing the same batches in the same order.
    smp_step()
    deepspeed_step()
    mine = models.local_chain(full, args.model, args.layers, [n for n, _ in model.local_named_parameters()])
    plain = torch.nn.ModuleList([copy.deepcopy(full.get_submodule(n)) for n in mine])
    # a chain module the cut splits between two ranks (the V order cuts inside a block) holds the other
    # rank's part as meta tensors (docs/pipeline.md, "Memory"): the timing copy gets zeros there
    for sub in plain.modules():
        for name, t in list(sub._parameters.items()):
            if t is not None and t.is_meta:
                sub._parameters[name] = torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype))
    first = smp.pp_rank() == 0  # holds stage 0 in the looped and the V order
    stage_batches = [models.stage_input(args.model, first, x, args.width) for x in batches[0][0].chunk(m)]

    def stage_step():
        for p in plain.parameters():
            p.grad = None
        for h in stage_batches:
            for layer in plain:
                h = layer(h)
            h.sum().backward()

    # one microbatch's activations through this rank's layers (the unit of the schedules' memory
    # formulas, M_B): held after its forward, before its backward
    one_mb = SavedActivations(plain.parameters())
    h = stage_batches[0] if first else stage_batches[0].detach().clone().requires_grad_(True)
    if first:  # the step's input batch: not counted (the caller holds it); a received activation is
        one_mb.skip(h)
    with one_mb:
        for layer in plain:
            h = layer(h)
    microbatch_bytes = one_mb.live
    del h

    fns = {"smp": smp_step, "deepspeed": deepspeed_step, "stage": stage_step}

    local = {name: [] for name in ENGINES}  # this rank's own time of each call (up to its end)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        local[fn.__name__[:-5]].append(time.perf_counter() - t0)
        dist.barrier()
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for _ in range(args.warmup):
        for name in ENGINES:
            timed(fns[name])
    times = {name: [] for name in ENGINES}
    if args.profile:  # cProfile of the smp steps only, one file per rank (pstats; read with python -m pstats)
        import cProfile

        profiler = cProfile.Profile()
        fns["smp"] = lambda: profiler.runcall(smp_step)
        fns["smp"].__name__ = "smp_step"
    for i in range(args.steps):
        order = ENGINES[i % 3:] + ENGINES[:i % 3]
        for name in order:
            times[name].append(timed(fns[name]))
    if args.profile:
        profiler.dump_stats(Path(args.profile) / f"{args.schedule}_m{m}_rank{dist.get_rank()}.pstats")
    # this rank's compute and schedule time of the measured smp steps (the engine's clock, idle_time.py)
    clock = model.runtime_engine.runner.clock.steps[-args.steps:]
    smp_step(count_held=True)  # untimed: the peak of the activations held (every step holds the same)
    # one microbatch's activation sent from rank 0 to rank 1 and back, both ranks otherwise idle:
    # the transfer cost each pipeline step pays per microbatch and stage boundary, without waiting
    one_way = []
    activation = torch.randn(args.batch // m, *((args.seq, args.width) if args.model == "gpt" else (args.width,)))
    for _ in range(args.warmup + 20):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(activation, 1)
            dist.recv(activation, 1)
        elif dist.get_rank() == 1:
            dist.recv(activation, 0)
            dist.send(activation, 0)
        one_way.append((time.perf_counter() - t0) / 2)
    write_result({"times": times, "losses": losses, "smp_stage": mine, "peak_held_bytes": held.peak,
                  "microbatch_bytes": microbatch_bytes,
                  "idle": [1 - busy / wall for wall, busy in clock],
                  "send_recv_s": statistics.median(one_way[args.warmup:]),
                  "busy_s": [busy for _, busy in clock], "wall_s": [wall for wall, _ in clock],
                  "local_times": {name: t[-args.steps:] for name, t in local.items()},
                  "deepspeed_parts": [int(x) for x in ds_module.parts], "pp_rank": smp.pp_rank()})
    smp.barrier()


class SavedActivations:
    """Peak bytes of the storages the autograd graphs of this rank hold for backward (activations)
    during the smp steps: what a schedule's microbatches in flight cost in memory. CPU has no
    allocator statistics, so the saved tensors are counted as the graph saves them
    (saved_tensors_hooks) and released when the graph frees them. Each storage counts once, however
    many saved tensors view it (tanh saves its output, the next Linear saves it as its input), and
    storages of parameters not at all (a Linear's matmul saves the transposed weight, a view of the
    parameter: no memory of its own)."""

    def __init__(self, params):
        import torch

        self.skipped = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}  # storage address -> saved tensors holding it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, t):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):  # torch.export tracing the model at the first step: no memory
            return _Held(t, None, self)
        # kept detached: a saved output holding its own grad_fn (node -> packed -> tensor -> node) is a
        # cycle through C++ that no collector frees; without the hook autograd avoids it, and under the
        # split backward (nodes of the input gradient kept by retain_graph) the cycle would keep them for ever
        t = t.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skipped:
            return _Held(t, None, self)
        if not self.refs.get(key):
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, (key, storage.nbytes()), self)

    def skip(self, tensor) -> None:
        """Leave this tensor's storage out (the step's input batch: the caller holds it anyway; the
        first stage's matmuls save views of it)."""
        self.skipped.add(tensor.untyped_storage().data_ptr())

    def release(self, entry) -> None:
        key, nbytes = entry
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def __enter__(self):
        self._hooks.__enter__()

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Held:
    __slots__ = ("tensor", "entry", "owner")

    def __init__(self, tensor, entry, owner):
        self.tensor, self.entry, self.owner = tensor, entry, owner

    def __del__(self):
        if self.entry is not None:
            self.owner.release(self.entry)


def predicted_idle(schedule: str, p: int, m: int, v: int, w: float) -> float:
    """The schedule's bubble as a fraction of its step, in units of one stage's F + B per microbatch
    (B: the whole backward; w = W / (F + B), the weight-gradient share): bubble b, step m + b."""
    b = {"interleaved": p - 1, "simple": p - 1, "interleaved_1f1b": (p - 1) / v, "zero_bubble": (p - 1) * (1 - 2 * w) / v,
         "zbv": (p - 1) * (1 - 2 * w) / 2, "dualpipev": max(0.0, (p - 1) * (1 - 3 * w) / 2)}[schedule]
    return b / (m + b)


def run_case(pp: int, m: int, schedule: str, args, out_dir: Path) -> dict:
    cmd = ["--worker", "--pp", pp, "--microbatches", m, "--steps", args.steps, "--warmup", args.warmup,
           "--model", args.model, "--width", args.width, "--layers", args.layers, "--batch", args.batch,
           "--seq", args.seq, "--vocab", args.vocab, "--schedule", schedule,
           *(["--profile", Path(args.profile).resolve()] if args.profile else [])]
    results = sorted(run_ranks(Path(__file__).resolve(), pp, cmd, out_dir, timeout=args.timeout),
                     key=lambda r: r["pp_rank"])
    r0 = results[0]
    med = {name: statistics.median(r0["times"][name]) for name in ENGINES}
    ideal = (m + pp - 1) / m * med["stage"]
    chain, cuts = models.chain_names(args.model, args.layers), r0["deepspeed_parts"]
    ds_parts = [chain[cuts[s]:cuts[s + 1]] for s in range(pp)]  # DeepSpeed's layer list is the chain
    smp_parts = [r["smp_stage"] for r in results]
    a, b = r0["losses"]["smp"], r0["losses"]["deepspeed"]
    n = min(len(a), len(b))
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n]))
    v = {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}.get(schedule, 1)
    return {"schedule": schedule, "pp": pp, "microbatches": m, "median_s": med, "ideal_s": ideal,
            "no_overlap_s": pp * med["stage"],
            "smp_over_ideal": med["smp"] / ideal, "deepspeed_over_ideal": med["deepspeed"] / ideal,
            "smp_over_deepspeed": med["smp"] / med["deepspeed"],
            "smp_over_deepspeed_paired": statistics.median(
                s / d for s, d in zip(r0["times"]["smp"], r0["times"]["deepspeed"])),
            "same_partition": smp_parts == ds_parts, "smp_parts": smp_parts, "deepspeed_parts": ds_parts,
            "loss_max_rel_diff": loss_diff, "losses_compared": n, "first_loss": a[0], "last_loss": a[n - 1],
            "idle": [statistics.median(r["idle"]) for r in results],
            "predicted_idle": predicted_idle(schedule, pp, m, v, 1 / 3),
            "send_recv_ms": 1e3 * r0["send_recv_s"],
            "busy_ms": [1e3 * statistics.median(r["busy_s"]) for r in results],
            "stage_ms": [1e3 * statistics.median(r["local_times"]["stage"]) for r in results],
            "peak_held_mib": [r["peak_held_bytes"] / 2**20 for r in results],
            "peak_held_microbatches": [r["peak_held_bytes"] / r["microbatch_bytes"] for r in results],
            "times": r0["times"]}


def print_tables(figures: list[dict]) -> None:
    print()
    print("| schedule | pp | m | idle per rank (measured, median) | predicted idle (F:B:W = 1:2:1) | peak held "
          "activations per rank, MiB (in microbatches: / one microbatch's activations of the rank's layers) |")
    print("| --- " * 6 + "|")
    for f in figures:
        held = ", ".join(f"{x:.2f} ({n:.2f})" for x, n in zip(f["peak_held_mib"], f["peak_held_microbatches"]))
        print(f"| {f['schedule']} | {f['pp']} | {f['microbatches']} | {', '.join(f'{x:.1%}' for x in f['idle'])} | "
              f"{f['predicted_idle']:.1%} | {held} |")
    print()
    print("| schedule | pp | m | smp compute per rank, ms (busy: its stages' chunks + step body) | plain stage per "
          "rank, ms (no communication) | one microbatch's activation sent one way, ms (ranks 0 -> 1, both idle) |")
    print("| --- " * 6 + "|")
    for f in figures:
        print(f"| {f['schedule']} | {f['pp']} | {f['microbatches']} | {', '.join(f'{x:.1f}' for x in f['busy_ms'])} | "
              f"{', '.join(f'{x:.1f}' for x in f['stage_ms'])} | {f['send_recv_ms']:.2f} |")


def print_summary(figures: list[dict], baseline: str = "interleaved") -> None:
    """Each schedule against 1F1B (``baseline``) of the same round, pp and m: the jobs of a round run
    one right after the other, so drift on a shared machine moves both; and against DeepSpeed's
    engine, paired step by step inside each job."""
    rounds = max(f["round"] for f in figures) + 1
    base = {(f["round"], f["pp"], f["microbatches"]): f for f in figures if f["schedule"] == baseline}
    print()
    print(f"| schedule | pp | m | smp step, ms (median of rounds) | smp / 1F1B, each of {rounds} round(s) | "
          "smp / 1F1B through DeepSpeed (each job's paired ratio over the 1F1B job's) | "
          "smp / DeepSpeed PipelineEngine (paired), each round | idle per rank (median of rounds) |")
    print("| --- " * 8 + "|")
    keys = sorted({(f["pp"], f["microbatches"], f["schedule"]) for f in figures},
                  key=lambda k: (k[0], k[1], SCHEDULES.index(k[2]) if k[2] in SCHEDULES else 99))
    for pp, m, schedule in keys:
        mine = sorted((f for f in figures if (f["pp"], f["microbatches"], f["schedule"]) == (pp, m, schedule)),
                      key=lambda f: f["round"])
        same_round = [(f, base[(f["round"], pp, m)]) for f in mine if (f["round"], pp, m) in base]
        vs_base = [f"{f['median_s']['smp'] / b['median_s']['smp']:.3f}" for f, b in same_round]
        # DeepSpeed's engine ran in each job, step by step beside smp: a load that slows one job
        # and not the other cancels out of this ratio
        via_deepspeed = [f"{f['smp_over_deepspeed_paired'] / b['smp_over_deepspeed_paired']:.3f}" for f, b in same_round]
        vs_deepspeed = [f"{f['smp_over_deepspeed_paired']:.3f}" for f in mine]
        idle = [statistics.median(f["idle"][r] for f in mine) for r in range(pp)]
        step_ms = 1e3 * statistics.median(f["median_s"]["smp"] for f in mine)
        print(f"| {schedule} | {pp} | {m} | {step_ms:.1f} | {', '.join(vs_base) or '-'} | "
              f"{', '.join(via_deepspeed) or '-'} | {', '.join(vs_deepspeed)} | "
              f"{', '.join(f'{x:.1%}' for x in idle)} |")


SCHEDULES = ("interleaved", "zero_bubble", "interleaved_1f1b", "zbv", "dualpipev")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="2,4", help="comma-separated pipeline degrees (one job each)")
    ap.add_argument("--microbatches", default="4,8,16", help="comma-separated microbatch counts")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="benchmarks/_pipeline_models.py")
    ap.add_argument("--width", type=int, default=None, help="hidden width (default: gpt 256, mlp 1024)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks / hidden layers (default 8)")
    ap.add_argument("--batch", type=int, default=None, help="sequences / samples per step (default: gpt 16, mlp 256)")
    ap.add_argument("--seq", type=int, default=32, help="gpt: tokens per sequence")
    ap.add_argument("--vocab", type=int, default=512, help="gpt: vocabulary size")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--schedule", default="interleaved",
                    help="comma-separated smp pipeline options to run, one job each (interleaved = 1F1B; "
                         f"zero_bubble, interleaved_1f1b, zbv, dualpipev; all = {','.join(SCHEDULES)})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every (pp, m, schedule) job this many times, the schedules in rotating order")
    ap.add_argument("--profile", default=None, help="write a cProfile of each rank's smp steps into this folder")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for key in ("width", "batch", "layers"):
        if getattr(args, key) is None:
            setattr(args, key, models.DEFAULTS[args.model][key])
    if args.worker:
        args.pp, args.microbatches = int(args.pp), int(args.microbatches)
        worker(args)
        return 0
    schedules = list(SCHEDULES) if args.schedule == "all" else args.schedule.split(",")
    pps = [int(x) for x in args.pp.split(",")]
    mbs = [int(x) for x in args.microbatches.split(",")]
    for pp in pps:
        if args.layers % pp:
            ap.error(f"--layers {args.layers} is not divisible by pp {pp}")
    for m in mbs:
        if args.batch % m:
            ap.error(f"--batch {args.batch} is not divisible by {m} microbatches")
    out_root = Path(tempfile.mkdtemp(prefix="smp_pp_bench_"))
    started = time.time()
    shape = (f"GPT-2 style: {args.layers} blocks of width {args.width}, {args.seq} tokens, vocabulary {args.vocab}"
             if args.model == "gpt" else f"{args.layers} x Linear({args.width}) + tanh, head Linear({args.width}, 10)")
    print(f"# pipeline: {shape}, batch {args.batch}, SGD, fp32; smp schedules {', '.join(schedules)} (DeepSpeed: "
          f"1F1B); {args.rounds} round(s); medians over {args.steps} steps; times in ms (slowest rank)")
    print("| round | schedule | pp | m | t_s (stage) | ideal (m+p-1)/m t_s | smp | smp / ideal | DeepSpeed pipe | "
          "DeepSpeed / ideal | smp / DeepSpeed (paired) | loss rel. diff |")
    print("| --- " * 12 + "|")
    figures = []
    for rnd in range(args.rounds):
        for pp in pps:
            for j, m in enumerate(mbs):
                shift = (rnd + j) % len(schedules)  # a schedule is not always first (or last) of its group
                for schedule in schedules[shift:] + schedules[:shift]:
                    f = run_case(pp, m, schedule, args, out_root / f"r{rnd}_pp{pp}_m{m}_{schedule}")
                    f["round"] = rnd
                    figures.append(f)
                    med = f["median_s"]
                    print(f"| {rnd} | {schedule} | {pp} | {m} | {med['stage'] * 1e3:.1f} | {f['ideal_s'] * 1e3:.1f} "
                          f"| {med['smp'] * 1e3:.1f} | {f['smp_over_ideal']:.2f} | {med['deepspeed'] * 1e3:.1f} "
                          f"| {f['deepspeed_over_ideal']:.2f} | {f['smp_over_deepspeed_paired']:.3f} "
                          f"| {f['loss_max_rel_diff']:.1e} |", flush=True)
    print_tables(figures)
    print_summary(figures)
    print()
    for f in figures:
        same = "same stages" if f["same_partition"] else "other stages"
        print(f"# r{f['round']} {f['schedule']} pp {f['pp']} m {f['microbatches']}: {same}: smp {f['smp_parts']}, "
              f"DeepSpeed {f['deepspeed_parts']}; losses {f['first_loss']:.6f} -> {f['last_loss']:.6f} over "
              f"{f['losses_compared']} steps")
    print(f"# wall time {time.time() - started:.0f} s; rank logs under {out_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
