"""Sharded data parallelism on one job, three ways: sdp = rdp (DeepSpeed ZeRO-3), sdp < rdp on the MiCS
engine (torch FSDP2, the default) and sdp < rdp on DeepSpeed ZeRO-3 + hpZ (SMP_ADAPTER_SDP_ENGINE=hpz).

The job: the seed-002-style ViT script of the tests (tests/distributed/scripts/train_vit.py: a tiny
ViTForImageClassification, Adam, activation checkpointing off), 4 ranks, 2 steps, every parameter
sharded (sdp_param_persistence_threshold 0), the communication ledger on. Per layout it prints
  * per-rank bytes of parameters, gradients and Adam moments, read from the tensors each rank holds
    (its shards: DTensor.to_local() on MiCS, ds_tensor (+ hpZ's secondary shard, + whole tensors while
    gathered) on DeepSpeed), the largest rank's, against the whole model's fp32 bytes;
  * the ledger's bytes per training step of rank 0 by group and collective. With 2 ranks per node
    (sdp 2 = a node), "sdp" traffic stays inside a node and everything else ("rdp", "replicate")
    crosses nodes: the "across groups" column.
What the bytes cost on a real slow link is benchmarks/cluster_comm.py's (RESULTS.md §14).

    .venv/bin/python benchmarks/sdp_engines.py          # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests/distributed"), str(ROOT / "adapter")]

LAYOUTS = {  # name -> (smp options, SMP_ADAPTER_SDP_ENGINE)
    "ZeRO-3, sdp 4 = rdp": ({"sharded_data_parallel_degree": 4}, "mics"),
    "MiCS, sdp 2 of 4": ({"sharded_data_parallel_degree": 2}, "mics"),
    "hpZ, sdp 2 of 4": ({"sharded_data_parallel_degree": 2}, "hpz"),
}
STEPS = 2


def run(name: str, options: dict, engine: str, out: Path) -> dict:
    from launch_util import run_ranks

    ledger = out / "ledger"
    opts = {"ddp": True, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0, **options}
    results = run_ranks(ROOT / "tests/distributed/scripts/train_vit.py", 4, out_dir=out, timeout=300,
                        args=["--optimizer", "adam", "--lr", "1e-3", "--steps", STEPS],
                        env={"SM_HP_MP_PARAMETERS": json.dumps(opts), "SMP_ADAPTER_SDP_ENGINE": engine,
                             "SMP_ADAPTER_COMM_LEDGER": str(ledger)})
    steps = [json.loads(line) for line in (ledger / "rank0.jsonl").read_text().splitlines()]
    per_op: dict = {}
    for record in (r for r in steps if r.get("step") is not None):
        for op in record["ops"]:
            key = (op["group"], op["op"])
            per_op[key] = per_op.get(key, 0) + op["bytes"] / STEPS
    whole = results[0]["total_param_bytes"]
    biggest = max(results, key=lambda r: r["param_bytes"])
    return {"whole": whole, "params": biggest["param_bytes"], "grads": biggest["grad_bytes"],
            "moments": biggest["adam_moment_bytes"], "per_op": per_op}


def main() -> int:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (options, engine)) in enumerate(LAYOUTS.items()):
            rows[name] = run(name, options, engine, Path(tmp) / str(i))
    whole = next(iter(rows.values()))["whole"]
    print(f"# tiny ViT, {whole:,} B of fp32 parameters; 4 ranks, 2 per node; Adam; per training step of rank 0\n")
    print("| layout | parameters / rank | gradients / rank | Adam moments / rank | inside the group (sdp) | "
          "across groups | what crosses |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        inside = sum(b for (g, _), b in r["per_op"].items() if g == "sdp")
        across = {k: b for k, b in r["per_op"].items() if k[0] != "sdp" and b > 64}  # not the 4-byte loss
        what = ", ".join(f"{g} {o} {b / 1e3:.1f} kB" for (g, o), b in sorted(across.items()))
        grads = (f"{r['grads']:,} B ({r['grads'] / whole:.3f})" if r["grads"]
                 else "in DeepSpeed's flat buffers (not p.grad; benchmarks/memory.py counts them)")
        print(f"| {name} | {r['params']:,} B ({r['params'] / whole:.3f}) | {grads} | "
              f"{r['moments']:,} B ({r['moments'] / whole:.3f}) | {inside / 1e3:.1f} kB | "
              f"{sum(across.values()) / 1e3:.1f} kB | {what} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
