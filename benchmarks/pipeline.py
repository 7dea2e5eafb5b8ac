"""Pipeline efficiency: smp pipeline steps against the pipeline ideal and against DeepSpeed's own
pipeline engine running the same job.

Job: an MLP of ``--layers`` Linear(width, width) + tanh layers and a Linear(width, 10) head with
log_softmax, NLL loss, SGD, batch ``--batch`` per step (data parallel degree 1: every rank is one
stage). Swept over pp in ``--pp`` (default 2,4) and microbatches in ``--microbatches`` (default
4,8,16); one job of pp processes (one CPU thread each, OMP_NUM_THREADS=1) per (pp, m).

Three things run in each job, in the same processes, on the same data, in rotating order every step
(so drift on a shared machine hits all three):
  smp        @smp.step (forward + backward of every microbatch through all stages, 1F1B:
             ``pipeline: interleaved``) + optimizer.step();
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
bytes of activations held for backward during the smp step (``SavedActivations``).

Both engines must train the same model: their stage assignments are printed and compared, and the
per-step losses of the two engines (same weights, same batches, same SGD) are compared.

Machine note: pp 4 on a 2-core machine runs 4 single-threaded ranks on 2 cores. t_s is measured
with all 4 ranks busy, as in the pipeline's steady state; during fill and drain fewer ranks are busy
and run faster than t_s / m per microbatch, so measured/ideal can fall below 1 there.

    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py                       # ~1.5 min on 2 cores
    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py --pp 2 --microbatches 8 --steps 10
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
from _common import quiet, run_ranks, write_result  # noqa: E402

LR = 1e-3
ENGINES = ("smp", "deepspeed", "stage")


def build(width: int, layers: int):
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return torch.log_softmax(self.head(x), 1)

    torch.manual_seed(0)
    return MLP()


def as_layer_list(model) -> list:
    """The MLP as the flat layer list DeepSpeed's PipelineModule wants (copies of the same weights)."""
    import copy

    from torch import nn

    layers = []
    for linear in model.layers:
        layers += [copy.deepcopy(linear), nn.Tanh()]
    return layers + [copy.deepcopy(model.head), nn.LogSoftmax(dim=1)]


def deepspeed_engine(model, pp: int, microbatches: int, batch: int):
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=as_layer_list(model), num_stages=pp, loss_fn=F.nll_loss,
                            partition_method="parameters", activation_checkpoint_interval=0)
    # batch arithmetic: train_batch_size (batch) = micro batch (batch / m) x gradient_accumulation_steps (m) x dp (1)
    config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // microbatches,
              "gradient_accumulation_steps": microbatches, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}, "wall_clock_breakdown": False}
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine, module


def stage_layer_names(model, local_names) -> list[str]:
    """Names of the MLP's Linear layers whose weights live on this rank, in order."""
    local = set(local_names)
    names = [f"layers.{i}" for i in range(len(model.layers))] + ["head"]
    return [n for n in names if f"{n}.weight" in local]


def worker(args) -> None:
    quiet()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp

    pp, m = args.pp, args.microbatches
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "ddp": True, "pipeline": args.schedule})
    quiet()
    full = build(args.width, args.layers)
    ds_engine, ds_module = deepspeed_engine(full, pp, m, args.batch)
    model = smp.DistributedModel(full)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, data, target):
        loss = F.nll_loss(model(data), target)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(4)]
    losses = {"smp": [], "deepspeed": []}
    counter = {"smp": 0, "deepspeed": 0}

    held = SavedActivations(full.parameters())

    def smp_step():
        data, target = batches[counter["smp"] % len(batches)]
        counter["smp"] += 1
        optimizer.zero_grad()
        held.skip(data)
        with held:
            losses["smp"].append(float(train_step(model, data, target).reduce_mean()))
        optimizer.step()

    def deepspeed_step():
        data, target = batches[counter["deepspeed"] % len(batches)]
        counter["deepspeed"] += 1
        microbatches = iter(zip(data.chunk(m), target.chunk(m)))
        losses["deepspeed"].append(float(ds_engine.train_batch(data_iter=microbatches)))

    # the first smp step partitions the model; after it, this rank's stage layers are known. Both
    # engines take one step here so that they go on seeing the same batches in the same order.
    smp_step()
    deepspeed_step()
    mine = stage_layer_names(full, [n for n, _ in model.local_named_parameters()])
    plain = torch.nn.ModuleList([torch.nn.Linear(args.width, 10 if n == "head" else args.width) for n in mine])
    first = smp.pp_rank() == 0
    stage_batches = [x.detach().clone() for x in batches[0][0].chunk(m)]

    def stage_step():
        for p in plain.parameters():
            p.grad = None
        for x in stage_batches:
            h = x.requires_grad_(not first)
            for name, layer in zip(mine, plain):
                h = torch.log_softmax(layer(h), 1) if name == "head" else torch.tanh(layer(h))
            h.sum().backward()

    # one microbatch's activations through this rank's layers (the unit of the schedules' memory
    # formulas, M_B): held after its forward, before its backward
    one_mb = SavedActivations(plain.parameters())
    h = stage_batches[0].clone().requires_grad_(not first)  # later stages: the received activation counts
    if first:
        one_mb.skip(h)
    with one_mb:
        for name, layer in zip(mine, plain):
            h = torch.log_softmax(layer(h), 1) if name == "head" else torch.tanh(layer(h))
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
    for i in range(args.steps):
        order = ENGINES[i % 3:] + ENGINES[:i % 3]
        for name in order:
            times[name].append(timed(fns[name]))
    # one microbatch's activation sent from rank 0 to rank 1 and back, both ranks otherwise idle:
    # the transfer cost each pipeline step pays per microbatch and stage boundary, without waiting
    one_way = []
    activation = torch.randn(args.batch // m, args.width)
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
    # this rank's compute and schedule time of the measured smp steps (the engine's clock, idle_time.py)
    clock = model.runtime_engine.runner.clock.steps[-args.steps:]
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


def _linear_names(parts: list[int], stage: int, layers: int) -> list[str]:
    """Which of the MLP's Linear layers DeepSpeed's partition puts on ``stage`` (layer list: Linear,
    Tanh, ..., head, LogSoftmax)."""
    names = []
    for i in range(parts[stage], parts[stage + 1]):
        if i % 2 == 0:
            names.append(f"layers.{i // 2}" if i // 2 < layers else "head")
    return names


def run_case(pp: int, m: int, args, out_root: Path) -> dict:
    cmd = ["--worker", "--pp", pp, "--microbatches", m, "--steps", args.steps, "--warmup", args.warmup,
           "--width", args.width, "--layers", args.layers, "--batch", args.batch, "--schedule", args.schedule]
    results = run_ranks(Path(__file__).resolve(), pp, cmd, out_root / f"pp{pp}_m{m}", timeout=args.timeout)
    r0 = results[0]
    med = {name: statistics.median(r0["times"][name]) for name in ENGINES}
    ideal = (m + pp - 1) / m * med["stage"]
    ds_parts = [_linear_names(r0["deepspeed_parts"], s, args.layers) for s in range(pp)]
    smp_parts = [r["smp_stage"] for r in sorted(results, key=lambda r: r["pp_rank"])]
    a, b = r0["losses"]["smp"], r0["losses"]["deepspeed"]
    n = min(len(a), len(b))
    loss_diff = max(abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n]))
    return {"pp": pp, "microbatches": m, "median_s": med, "ideal_s": ideal, "no_overlap_s": pp * med["stage"],
            "smp_over_ideal": med["smp"] / ideal, "deepspeed_over_ideal": med["deepspeed"] / ideal,
            "smp_over_deepspeed": med["smp"] / med["deepspeed"],
            "smp_over_deepspeed_paired": statistics.median(
                s / d for s, d in zip(r0["times"]["smp"], r0["times"]["deepspeed"])),
            "same_partition": smp_parts == ds_parts, "smp_parts": smp_parts, "deepspeed_parts": ds_parts,
            "loss_max_rel_diff": loss_diff, "losses_compared": n, "first_loss": a[0], "last_loss": a[n - 1],
            "idle": [statistics.median(r["idle"]) for r in sorted(results, key=lambda r: r["pp_rank"])],
            "predicted_idle": predicted_idle(args.schedule, pp, m, {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}.get(
                args.schedule, 1), 1 / 3),
            "send_recv_ms": 1e3 * r0["send_recv_s"],
            "busy_ms": [1e3 * statistics.median(r["busy_s"]) for r in sorted(results, key=lambda r: r["pp_rank"])],
            "stage_ms": [1e3 * statistics.median(r["local_times"]["stage"]) for r in sorted(results, key=lambda r: r["pp_rank"])],
            "peak_held_mib": [r["peak_held_bytes"] / 2**20 for r in sorted(results, key=lambda r: r["pp_rank"])],
            "peak_held_microbatches": [r["peak_held_bytes"] / r["microbatch_bytes"]
                                       for r in sorted(results, key=lambda r: r["pp_rank"])],
            "times": r0["times"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", default="2,4", help="comma-separated pipeline degrees (one job each)")
    ap.add_argument("--microbatches", default="4,8,16", help="comma-separated microbatch counts")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--schedule", default="interleaved",
                    help="smp side's pipeline option (interleaved = 1F1B; interleaved_1f1b, zero_bubble, zbv, dualpipev)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.pp, args.microbatches = int(args.pp), int(args.microbatches)
        worker(args)
        return 0
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
    print(f"# pipeline: {args.layers} x Linear({args.width}) + tanh, head Linear({args.width}, 10), batch "
          f"{args.batch}, SGD, fp32; smp pipeline: {args.schedule} (DeepSpeed: 1F1B); medians over {args.steps} steps; times in ms (slowest rank)")
    print("| pp | m | t_s (stage) | ideal (m+p-1)/m t_s | no overlap p t_s | smp | smp / ideal | DeepSpeed pipe | "
          "DeepSpeed / ideal | smp / DeepSpeed (paired) | loss rel. diff |")
    print("| --- " * 11 + "|")
    figures = []
    for pp in pps:
        for m in mbs:
            f = run_case(pp, m, args, out_root)
            figures.append(f)
            med = f["median_s"]
            print(f"| {pp} | {m} | {med['stage'] * 1e3:.1f} | {f['ideal_s'] * 1e3:.1f} | {f['no_overlap_s'] * 1e3:.1f} "
                  f"| {med['smp'] * 1e3:.1f} | {f['smp_over_ideal']:.2f} | {med['deepspeed'] * 1e3:.1f} "
                  f"| {f['deepspeed_over_ideal']:.2f} | {f['smp_over_deepspeed']:.2f} "
                  f"({f['smp_over_deepspeed_paired']:.2f}) | {f['loss_max_rel_diff']:.1e} |", flush=True)
    print()
    print("| pp | m | idle per rank (measured, median) | predicted idle (F:B:W = 1:2:1) | peak held activations "
          "per rank, MiB (in microbatches: / one microbatch's activations of the rank's layers) |")
    print("| --- " * 5 + "|")
    for f in figures:
        held = ", ".join(f"{x:.2f} ({n:.2f})" for x, n in zip(f["peak_held_mib"], f["peak_held_microbatches"]))
        print(f"| {f['pp']} | {f['microbatches']} | {', '.join(f'{x:.1%}' for x in f['idle'])} | "
              f"{f['predicted_idle']:.1%} | {held} |")
    print()
    print("| pp | m | smp compute per rank, ms (busy: its stages' chunks + step body) | plain stage per rank, ms "
          "(no communication) | one microbatch's activation sent one way, ms (ranks 0 -> 1, both idle) |")
    print("| --- " * 5 + "|")
    for f in figures:
        print(f"| {f['pp']} | {f['microbatches']} | {', '.join(f'{x:.1f}' for x in f['busy_ms'])} | "
              f"{', '.join(f'{x:.1f}' for x in f['stage_ms'])} | {f['send_recv_ms']:.2f} |")
    print()
    for f in figures:
        same = "same stages" if f["same_partition"] else "DIFFERENT stages"
        print(f"# pp {f['pp']} m {f['microbatches']}: {same}: smp {f['smp_parts']}, DeepSpeed {f['deepspeed_parts']}; "
              f"losses {f['first_loss']:.6f} -> {f['last_loss']:.6f} over {f['losses_compared']} steps")
    print(f"# wall time {time.time() - started:.0f} s; rank logs under {out_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
