"""`benchmarks/memory.py --pipeline-rss`: what a pipeline rank holds of the model, by the kernel's
count. The deep-MLP probe of tests/distributed/scripts/pipeline_memory.py (SGD, fp32: parameters
and gradients only) runs through `smp-adapter launch --cpu --launcher torchrun` at pp 1, 2 and 4,
with and without delayed parameter initialisation, one job at a time. Per rank:

  held    bytes of parameter storage after the first step (another stage's parameters are meta)
  RSS     resident memory between steps over the rank's own baseline taken before the model exists,
          after the C library returned its free heap (the probe says why)
  peak    the kernel's peak resident memory (getrusage) over the same baseline, untrimmed

against the ideal: the model's bytes / pp for held, and the pp 1 run's figure / pp for RSS and peak
(pp 1 runs the DeepSpeed engine; its peak includes its first step's transients)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests/distributed/scripts/pipeline_memory.py"


def _job(pp: int, delayed: bool, size: list[str], out: Path, timeout: float) -> list[dict]:
    options = {"pipeline_parallel_degree": pp, "microbatches": 4, "ddp": True}
    cmd = [sys.executable, "-c", "from smp_adapter.cli import main; raise SystemExit(main())", "launch", "--cpu",
           "--launcher", "torchrun", "--nproc-per-node", str(pp), "--job-dir", str(out / "job"),
           "--timeout", str(int(timeout)), "--options", json.dumps(options), str(PROBE), "--results", str(out),
           "--delayed", str(int(delayed)), *size]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=out.parent)
    if done.returncode != 0:
        raise SystemExit(f"pp {pp} delayed={delayed} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(pp)]


def run(layers: int, width: int, out_root: Path, timeout: float) -> dict:
    size = ["--layers", str(layers), "--width", str(width), "--steps", "3"]
    started = time.time()
    figures = {}
    mib = 2**20
    print(f"# pipeline memory: MLP of {layers} x Linear({width}, {width}) fp32, SGD, 3 steps, microbatches 4; "
          "MiB over each rank's pre-model baseline (max over ranks; ratio to pp 1's)")
    print()
    print("| delayed init | pp | held params (ideal) | RSS between steps | ratio | peak RSS | ratio | losses = pp 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for delayed in (True, False):
        single = None
        for pp in (1, 2, 4):
            out = out_root / f"pp{pp}_{'delayed' if delayed else 'whole'}"
            out.mkdir(parents=True, exist_ok=True)
            ranks = _job(pp, delayed, size, out, timeout)
            figures[f"pp{pp}_{'delayed' if delayed else 'whole'}"] = ranks
            held = max(r["held_parameter_bytes"] for r in ranks)
            growth = max(r["rss_growth"] for r in ranks)
            peak = max(r["peak_rss_growth"] for r in ranks)
            if pp == 1:
                single = ranks[0]
            same = all(r["losses"] == single["losses"] for r in ranks)
            ideal = ranks[0]["model_bytes"] / pp
            print(f"| {'yes' if delayed else 'no'} | {pp} | {held / mib:.1f} ({ideal / mib:.1f}) | {growth / mib:.1f} | "
                  f"{growth / single['rss_growth']:.3f} | {peak / mib:.1f} | {peak / single['peak_rss_growth']:.3f} | "
                  f"{'bitwise' if same else 'NO'} |", flush=True)
    print()
    print(f"# wall time {time.time() - started:.0f} s; results under {out_root}")
    return figures
