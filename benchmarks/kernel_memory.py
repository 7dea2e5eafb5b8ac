"""Per-rank memory as the kernel counts it (VmRSS / VmHWM), against plain PyTorch's one-process run of
the same model: the wrap peak, the run's peak and the resident growth after the steps, for every engine,
with a breakdown of the rank's live tensor bytes (benchmarks/_kernel_memory_rank.py says how each is read).

Models (issue 60's): an nn.Sequential of 16 x (Linear(2048, 2048), Tanh), 256 MiB fp32 and no ModuleList;
a GPT-2 of n_embd 1024, 4 layers, 16 heads, vocabulary 8192 (embeddings tied), 224 MiB. Each model is
created inside smp.delay_param_initialization() (plain PyTorch: created normally); ``gpt2_pretrained`` is
that GPT-2 written by save_pretrained and loaded with from_pretrained in every mode (the wrap peak is then
what loading into shards costs). Trained 3 SGD steps
(no momentum: no optimizer state) on 4 rows per replica, fp32. glibc's mmap threshold is fixed at 128 KiB
for every process (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_) so that freed tensors leave RSS.

    PYTHONPATH=adapter .venv/bin/python benchmarks/kernel_memory.py [--models mlp,gpt2] [--layouts ...]

Prints one table per model: each row a layout, the max over its ranks of each figure, in MiB and as a
ratio (wrap peak: through smp.DistributedModel, before the optimizer, / the model's bytes; run peak and growth / plain PyTorch's and / smp's one-process
run), whether rank 0's first loss equals plain PyTorch's within 1e-5 (the same model on the same 4 rows;
later steps average every replica's rows, plain PyTorch trains on 4), and the tensor breakdown of rank 0.
Memory figures do not depend on CPU load; run it alone anyway (it starts up to 4 ranks at once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_ranks  # noqa: E402

RANK = Path(__file__).resolve().parent / "_kernel_memory_rank.py"
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
# name -> (smp options, ranks, sdp engine, what it is)
LAYOUTS = {
    "smp1": ({"ddp": True}, 1, None, "smp, 1 process, ddp"),
    "ddp2": ({"ddp": True}, 2, None, "ddp, 2 ranks"),
    "zero1": ({"ddp": True, "shard_optimizer_state": True}, 2, None, "ZeRO-1 (shard_optimizer_state), 2 ranks"),
    "zero3_sdp2": ({"ddp": True, "sharded_data_parallel_degree": 2}, 2, None, "ZeRO-3, sdp 2 of 2"),
    "zero3_sdp4": ({"ddp": True, "sharded_data_parallel_degree": 4}, 4, None, "ZeRO-3, sdp 4 of 4"),
    "hpz": ({"ddp": True, "sharded_data_parallel_degree": 2}, 4, "hpz", "ZeRO-3 + hpZ, sdp 2 of 4"),
    "mics": ({"ddp": True, "sharded_data_parallel_degree": 2}, 4, "mics", "MiCS, sdp 2 of 4"),
    "pp2": ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, 2, None, "pp 2"),
    "tp2": ({"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True}, 2, None, "tp 2"),
}
MIB = 2**20


EXTRA_OPTIONS: dict = {}  # --options: merged into every layout's


def saved_checkpoint(root: Path) -> Path:
    """The GPT-2 that ``gpt2_pretrained`` loads, written once by ``save_pretrained`` (safetensors)."""
    folder = root / "gpt2_checkpoint"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, str(RANK), "--model", "gpt2", "--mode", "save", "--out", str(folder)],
                       check=True, env={**os.environ, "PYTHONPATH": str(RANK.parents[1] / "adapter")})
    return folder


def run_layout(model: str, name: str, out: Path) -> list[dict]:
    env = dict(MALLOC)
    if model == "gpt2_pretrained":
        env["KERNEL_MEMORY_CHECKPOINT"] = str(saved_checkpoint(out.parents[1]))
    if name == "plain":
        return run_ranks(RANK, 1, ["--model", model, "--mode", "plain", "--out", out], out, env=env, timeout=900)
    options, ranks, engine, _ = LAYOUTS[name]
    env["SMP_OPTIONS"] = json.dumps({**options, **EXTRA_OPTIONS})
    if engine:
        env["SMP_ADAPTER_SDP_ENGINE"] = engine
    return run_ranks(RANK, ranks, ["--model", model, "--mode", "smp", "--out", out], out, env=env, timeout=900)


def table(model: str, layouts: list[str], root: Path) -> dict:
    plain = run_layout(model, "plain", root / model / "plain")[0]
    results = {"plain": [plain]}
    smp1 = None
    size = plain["model_bytes"]
    print(f"\n## {model}: {size / MIB:.0f} MiB of fp32 parameters; MiB over each rank's pre-model baseline, "
          "max over ranks")
    print(f"plain PyTorch, 1 process: wrap peak {plain['wrap_peak'] / MIB:.0f} ({plain['wrap_peak'] / size:.2f} x model), "
          f"run peak {plain['run_peak'] / MIB:.0f}, after the steps {plain['after'] / MIB:.0f}\n")
    print("| layout | wrap peak (x model) | run peak (x plain, x smp 1 proc) | after steps (x plain) "
          "| first loss = plain | rank 0 tensors: params / grads / other |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in layouts:
        ranks = run_layout(model, name, root / model / name)
        results[name] = ranks
        if name == "smp1":
            smp1 = ranks[0]
        wrap, run, after = (max(r[k] for r in ranks) for k in ("wrap_peak", "run_peak", "after"))
        # the first step's loss: the same model on the same 4 rows (later steps average more replicas' rows)
        same = abs(ranks[0]["losses"][0] - plain["losses"][0]) < 1e-5
        t = ranks[0]["tensors"]
        vs_smp = f", {run / smp1['run_peak']:.2f}" if smp1 else ""
        print(f"| {LAYOUTS[name][3]} | {wrap / MIB:.0f} ({wrap / size:.2f}) | {run / MIB:.0f} "
              f"({run / plain['run_peak']:.2f}{vs_smp}) | {after / MIB:.0f} ({after / plain['after']:.2f}) | "
              f"{'yes' if same else 'NO ' + str(ranks[0]['losses'][0])} | {t['parameters'] / MIB:.0f} / "
              f"{t['gradients'] / MIB:.0f} / {t['other'] / MIB:.0f} |", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,gpt2", help="comma-separated: mlp, gpt2, gpt2_pretrained")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", help="write every rank's figures here")
    parser.add_argument("--options", default="{}", help="smp options (JSON) added to every layout's")
    parser.add_argument("--workdir", help="keep the ranks' logs and figures here (default: a temporary folder)")
    args = parser.parse_args(argv)
    EXTRA_OPTIONS.update(json.loads(args.options))
    layouts = args.layouts.split(",")
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
    if "smp1" in layouts:  # the ratios against smp's one-process run need it first
        layouts.remove("smp1")
        layouts.insert(0, "smp1")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kernel-memory-") as tmp:
        root = Path(args.workdir or tmp)
        figures = {model: table(model, layouts, root) for model in args.models.split(",")}
    print(f"\n# wall time {time.time() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
