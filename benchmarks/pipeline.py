"""Pipeline overlap: is a pipeline-parallel smp step as fast as the pipeline ideal?

Job: an MLP of ``--layers`` Linear(width, width) + tanh layers (even split: half per stage), pp 2,
``--microbatches`` m (default 8), ``pipeline: interleaved`` (1F1B), SGD, per-rank batch ``--batch``.

Measured, in the same two processes (one CPU core each, OMP_NUM_THREADS=1):
  * pipeline step: barrier, @smp.step (forward + backward of every microbatch through both stages)
    + optimizer.step(), barrier; the slowest rank's time;
  * single-stage time t_s: each rank runs *its own half* of the model as a plain module, forward +
    backward of the same m microbatches, no communication, both ranks at once (same CPU contention
    as the pipeline); the slower rank's time.
Steps alternate pipeline / single-stage so drift on a shared machine hits both; medians are reported.

  ideal      = (m + p - 1) / m x t_s     (fill and drain bubble of p - 1 microbatch slots)
  no overlap = p x t_s                   (stages run one after the other)

Overlap is real when the measured step is well below p x t_s and near the ideal.

    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py
    PYTHONPATH=adapter .venv/bin/python benchmarks/pipeline.py --microbatches 8 --steps 10 --json out.json

``probe()`` / ``NOT_IMPLEMENTED`` are kept for benchmarks/memory.py: whether this checkout's smp.init
accepts pipeline_parallel_degree=2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_ranks, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PP = 2
NOT_IMPLEMENTED = "PP: not implemented (smp.init raises UnsupportedFeatureError)"
OPTIONS = {"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}


def probe(timeout: float = 120) -> tuple[bool, str]:
    """(implemented, detail): whether smp.init accepts pipeline_parallel_degree=2 on 2 ranks."""
    try:
        results = run_ranks(Path(__file__).resolve(), 2, ["--probe-worker"],
                            Path(tempfile.mkdtemp(prefix="smp_pp_probe_")), timeout=timeout)
    except RuntimeError as exc:
        return False, f"probe failed: {str(exc).splitlines()[0]}"
    r = results[0]
    if r["raised"] is None:
        return True, "smp.init accepted pipeline_parallel_degree=2"
    return False, f"smp.init raised {r['raised']}: {r['message']}"


def _probe_worker() -> None:
    import smdistributed.modelparallel.torch as smp

    try:
        smp.init(OPTIONS)
    except Exception as exc:  # report any failure, the caller decides
        write_result({"raised": type(exc).__name__, "message": str(exc).splitlines()[0]})
        return
    write_result({"raised": None, "message": ""})
    smp.barrier()


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


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": PP, "microbatches": args.microbatches, "ddp": True,
              "pipeline": "interleaved"})
    full = build(args.width, args.layers)
    # this rank's half, as a plain module, for the single-stage time
    half = args.layers // PP
    mine = list(full.layers[smp.pp_rank() * half:(smp.pp_rank() + 1) * half])
    if smp.pp_rank() == PP - 1:
        mine.append(full.head)
    plain = torch.nn.ModuleList([type(m)(m.in_features, m.out_features) for m in mine])
    model = smp.DistributedModel(full)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    data = torch.randn(args.batch, args.width, generator=g)
    target = torch.randint(0, 10, (args.batch,), generator=g)
    mbs = data.chunk(args.microbatches)

    def pipeline_step():
        optimizer.zero_grad()
        train_step(model, data, target).reduce_mean()
        optimizer.step()

    def single_stage():
        for p in plain.parameters():
            p.grad = None
        for x in mbs:
            h = x.requires_grad_(smp.pp_rank() > 0)
            for i, m in enumerate(plain):
                h = m(h)
                h = torch.tanh(h) if i < len(plain) - 1 or smp.pp_rank() < PP - 1 else torch.log_softmax(h, 1)
            h.sum().backward()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        t = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for _ in range(2):  # warm-up (the first step also partitions)
        timed(pipeline_step)
        timed(single_stage)
    pipe_t, stage_t = [], []
    for i in range(args.steps):
        order = (pipeline_step, single_stage) if i % 2 == 0 else (single_stage, pipeline_step)
        for fn in order:
            (pipe_t if fn is pipeline_step else stage_t).append(timed(fn))
    if smp.rank() == 0:
        Path(os.environ["BENCH_PP_OUT"]).write_text(json.dumps({"pipeline_s": pipe_t, "stage_s": stage_t}))


def main() -> int:
    if "--probe-worker" in sys.argv:
        _probe_worker()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="smp_pp_bench_")) / "result.json"
    procs = []
    for rank in range(PP):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "OMPI_", "RANK", "LOCAL_", "WORLD_"))}
        env.update({"RANK": str(rank), "WORLD_SIZE": str(PP), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(PP),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                    "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "BENCH_PP_OUT": str(out),
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "adapter"), env.get("PYTHONPATH", "")])})
        cmd = [sys.executable, __file__, "--worker", "--microbatches", str(args.microbatches), "--steps",
               str(args.steps), "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if rank else None))
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        print(f"benchmark ranks failed: exit codes {codes}", file=sys.stderr)
        return 1
    r = json.loads(out.read_text())
    m, p = args.microbatches, PP
    t_pipe, t_stage = statistics.median(r["pipeline_s"]), statistics.median(r["stage_s"])
    ideal = (m + p - 1) / m * t_stage
    figures = {"pp": p, "microbatches": m, "schedule": "interleaved (1F1B)", "step_s": t_pipe,
               "single_stage_s": t_stage, "ideal_s": ideal, "no_overlap_s": p * t_stage,
               "step_over_ideal": t_pipe / ideal, "step_over_no_overlap": t_pipe / (p * t_stage),
               "samples": r}
    print(f"pipeline parallel, pp={p}, microbatches={m}, 1F1B, {args.layers} x Linear({args.width}), batch {args.batch}")
    print(f"  single-stage time t_s (median)       {t_stage * 1e3:8.1f} ms")
    print(f"  ideal (m+p-1)/m x t_s                {ideal * 1e3:8.1f} ms")
    print(f"  no overlap p x t_s                   {p * t_stage * 1e3:8.1f} ms")
    print(f"  measured pipeline step (median)      {t_pipe * 1e3:8.1f} ms   = {t_pipe / ideal:.2f} x ideal, "
          f"{t_pipe / (p * t_stage):.2f} x no-overlap")
    print(f"  spread: step {min(r['pipeline_s']) * 1e3:.1f}-{max(r['pipeline_s']) * 1e3:.1f} ms, "
          f"stage {min(r['stage_s']) * 1e3:.1f}-{max(r['stage_s']) * 1e3:.1f} ms over {len(r['stage_s'])} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
