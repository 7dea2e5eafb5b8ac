"""Per-rank memory of the smp runtime: parameter, gradient and optimizer-state bytes for each mode,
against the ideal.

Every job trains the overhead benchmark's GPT-2-style model (fp32, AdamW) through the smp API for
two full steps (so Adam's state exists), then runs the step function of a third step and counts,
*before* optimizer.step() (gradients reduced and held, optimizer state alive):

  parameters   module parameters: p.data (ZeRO 0/1: views of DeepSpeed's flat buffer), under ZeRO-3
               p.ds_tensor (this rank's shard) + p.data when materialised (persistent parameters,
               gathered ones) + hpZ's p.ds_secondary_tensor
  gradients    p.grad, DeepSpeed's gradient partitions (ZeRO-1 averaged_gradients and fp32 .grad,
               ZeRO-3 grad_partitions_flat_buffer)
  optimizer    DeepSpeed's fp32 master partitions (ZeRO-1 keeps one even in fp32 training; an fp32
               ZeRO-3 job's optimizer steps the parameter partition itself) and the torch
               optimizer's state (Adam moments)
  buffers      DeepSpeed's reduce buckets (ZeRO-3 ipg buckets, allocated reduce_bucket_size
               elements; on CPU only the touched pages become resident)
  other        any other tensor reachable from the DeepSpeed optimizer object

Pipeline parallelism (cases pp2, pp4): a GPT-2 of 16 blocks and a 512-token vocabulary (blocks
dominate, as in real models; the benchmark model's 4096-token tied embedding is 56% of its bytes and
no contiguous split could reach total/pp), counted per stage against total / pp. Parameters tied
across stages (wte / lm_head) are held by both the first and the last stage (docs/pipeline.md).

Each storage is counted once (tensors are deduplicated by storage), with the storage's full size.
Ideal per rank, P = parameter count, 4 bytes each (fp32):
  ZeRO 0       params 4P, grads 4P, optimizer 8P (Adam moments; the fp32 params are the master)
  ZeRO 1       params 4P, grads 4P, optimizer 12P / dp (fp32 master + moments, sharded)
  ZeRO 3, hpZ  params 4P / sdp, grads 4P / sdp, optimizer 8P / sdp (moments; the partition is the master)
  TP           split layers / tp + the rest, for params and grads; optimizer 2x that (ZeRO 0)
  PP           total / pp for params and grads; optimizer 2x that (ZeRO 0), / dp with
               shard_optimizer_state

    PYTHONPATH=adapter .venv/bin/python benchmarks/memory.py
    PYTHONPATH=adapter .venv/bin/python benchmarks/memory.py --pipeline-rss [--layers 16 --width 2048]

--pipeline-rss: what each pipeline rank holds of the model by the kernel's count (resident memory
between steps and its peak) with and without delayed parameter initialisation, at pp 1, 2 and 4
(benchmarks/_pipeline_rss.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (LR, MICROBATCHES, MODEL, MODES, PER_RANK_BATCH, SEQ, batch, build_model, lm_train_step, quiet,  # noqa: E402
                     run_ranks, write_result)

CASES = {
    **{k: (opts, n, label) for k, (opts, n, label) in MODES.items()},
    "zero3_default": ({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": MICROBATCHES}, 2,
                      "ZeRO 3, smp default sdp_param_persistence_threshold (1e6)"),
    "tp2": ({"ddp": True, "tensor_parallel_degree": 2, "microbatches": MICROBATCHES}, 2, "TP 2 (tensor_parallel_degree)"),
}
PP_MODEL = {"n_layer": 16, "vocab_size": 512}
# case -> (pp, dp): PP 2 and PP 4 alone; PP 2 x DP 2 with shard_optimizer_state (optimizer state / dp)
PP_CASES = {"pp2": (2, 1), "pp4": (4, 1), "pp2_dp2_sos": (2, 2)}


# =============================================================================================
# worker
# =============================================================================================
class Ledger:
    """Bytes per category, each storage counted once (the first category that claims it)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.bytes[category] = self.bytes.get(category, 0) + storage.nbytes()


def _tensors(obj, depth=0):
    """Tensors reachable from obj through lists, tuples, dicts (3 levels)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def count(model, engine) -> dict:
    ledger = Ledger()
    module = model.module
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            ledger.add("params", p.ds_tensor)
            ledger.add("params", getattr(p, "ds_secondary_tensor", None))
            ledger.add("params", p.data)  # materialised (persistent or still gathered)
        else:
            ledger.add("params", p.data)
    for p in module.parameters():
        ledger.add("grads", p.grad)
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    for t in _tensors(getattr(opt, "averaged_gradients", {})):
        ledger.add("grads", t)
    ledger.add("grads", getattr(opt, "grad_partitions_flat_buffer", None))
    masters = list(getattr(opt, "single_partition_of_fp32_groups", [])) + list(getattr(opt, "fp32_partitioned_groups_flat", []))
    for t in masters:
        ledger.add("grads", t.grad)
    for t in masters:
        ledger.add("optimizer", t)
    for state in inner.state.values():
        for t in _tensors(state):
            ledger.add("optimizer", t)
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        ledger.add("buffers", getattr(bucket, "buffer", None))
    for t in _tensors(getattr(opt, "ipg_buffer", None)):
        ledger.add("buffers", t)
    other_names = {}
    if opt is not inner:  # anything else the DeepSpeed optimizer holds
        for name, value in vars(opt).items():
            before = ledger.bytes.get("other", 0)
            for t in _tensors(value):
                ledger.add("other", t)
            if ledger.bytes.get("other", 0) > before:
                other_names[name] = ledger.bytes["other"] - before
    return dict(ledger.bytes, other_names=other_names)


def worker(args) -> None:
    quiet()
    import torch

    import smdistributed.modelparallel.torch as smp

    options = json.loads(args.options)
    smp.init(options)
    quiet()
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    full = build_model()
    total_params = sum(p.numel() for p in full.parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    if smp.tp_size() > 1:
        with smp.tensor_parallelism():
            model = build_model()
    else:
        model = build_model()
    del full
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    train_step = lm_train_step(smp)

    reader = smp.rdp_rank() if smp.state.cfg.prescaled_batch else smp.dp_rank()
    for step in range(3):
        optimizer.zero_grad()
        train_step(model, batch(step, reader).to(device))
        if step < 2:
            optimizer.step()
    engine = model.engine
    held = count(model, engine)
    tp = smp.tp_size()
    split_local = sum(p.numel() * p.element_size() for p in model.module.parameters() if model.is_distributed_parameter(p))
    local_all = sum(p.numel() * p.element_size() for p in model.module.parameters()) if tp > 1 else None
    write_result({"held": held, "total_params": total_params, "total_bytes": total_bytes, "tp": tp,
                  "split_local_bytes": split_local, "local_param_bytes": local_all,
                  "dp": smp.dp_size(), "rdp": smp.rdp_size(), "sdp": smp.state.cfg.sharded_data_parallel_degree,
                  "zero_stage": engine.zero_optimization_stage(),
                  "hpz": engine.zero_hpz_partition_size() if engine.zero_optimization_stage() == 3 else 1,
                  "persistence_threshold": (engine.config.get("zero_optimization", {})
                                            .get("stage3_param_persistence_threshold")),
                  "reduce_bucket_size": engine.config.get("zero_optimization", {}).get("reduce_bucket_size")})
    smp.barrier()


def pp_worker(pp: int, shard: bool) -> None:
    """PP: each stage's parameters, gradients and Adam state against total / pp (optimizer state
    also / dp with shard_optimizer_state). Parameters tied across stages (GPT-2's wte / lm_head) are
    held by both stages (docs/pipeline.md)."""
    quiet()
    import torch
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "pipeline_parallel_degree": pp, "microbatches": MICROBATCHES,
              "shard_optimizer_state": shard})
    quiet()
    model = build_model(**PP_MODEL)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))

    @smp.step
    def train_step(model, input_ids):
        logits = model(input_ids=input_ids)["logits"]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
        model.backward(loss)
        return loss

    for step in range(3):
        optimizer.zero_grad()
        train_step(model, batch(step, smp.dp_rank(), vocab=PP_MODEL["vocab_size"]))
        if step < 2:
            optimizer.step()
    local = list(model.local_parameters())
    ledger = Ledger()
    for p in local:
        ledger.add("params", p.data)
        ledger.add("grads", p.grad)
    for p in local:
        for t in _tensors(optimizer.optimizer.state.get(p, {})):
            ledger.add("optimizer", t)
    write_result({"held": ledger.bytes, "total_bytes": total_bytes, "pp_rank": smp.pp_rank()})
    smp.barrier()


def pp_row(pp: int, dp: int, out_root: Path, timeout: float) -> tuple[str, str, list]:
    shard = dp > 1
    results = run_ranks(Path(__file__).resolve(), pp * dp, ["--pp-worker", pp, *(["--shard"] if shard else [])],
                        out_root / f"pp{pp}_dp{dp}", timeout=timeout)
    ideal_params = results[0]["total_bytes"] / pp
    ideal = {"params": ideal_params, "grads": ideal_params, "optimizer": 2 * ideal_params / dp}
    cells, ratio = held_against_ideal(results, ideal)
    label = f"PP {pp} x DP {dp}, shard_optimizer_state" if shard else f"PP {pp}"
    row = [f"{label} (per stage; GPT-2 {PP_MODEL})", str(pp * dp), *cells, mib(0), mib(0)]
    stages = ", ".join(f"stage {r['pp_rank']}: {r['held'].get('params', 0) / 2**20:.2f} MiB"
                       for r in sorted(results, key=lambda r: r["pp_rank"]))
    note = f"{label}: parameters per stage ({stages}); the tied wte/lm_head is held by the first and the last stage"
    return "| " + " | ".join(row) + " |", note, {"ranks": results, "ratio": ratio}


def held_against_ideal(results: list[dict], ideal: dict) -> tuple[list[str], dict]:
    """Table cells 'held (ideal)', 'ratio' per category (the most any rank holds) and the ratios."""
    cells, ratio = [], {}
    for cat in ("params", "grads", "optimizer"):
        held = max(r["held"].get(cat, 0) for r in results)
        ratio[cat] = held / ideal[cat]
        cells += [f"{mib(held)} ({mib(ideal[cat]).strip()})", f"{ratio[cat]:.3f}"]
    return cells, ratio


# =============================================================================================
# launcher
# =============================================================================================
def ideal(r: dict) -> dict:
    B, stage = r["total_bytes"], r["zero_stage"]
    if r["tp"] > 1:
        split_full = r["split_local_bytes"] * r["tp"]
        p = B - split_full + split_full / r["tp"]
        return {"params": p, "grads": p, "optimizer": 2 * p}
    if stage == 0:
        return {"params": B, "grads": B, "optimizer": 2 * B}
    if stage == 1:
        return {"params": B, "grads": B, "optimizer": 3 * B / r["dp"]}
    sdp = r["sdp"]
    return {"params": B / sdp, "grads": B / sdp, "optimizer": 2 * B / sdp}


def mib(x) -> str:
    return f"{x / 2**20:8.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    all_cases = [*CASES, *PP_CASES]
    p.add_argument("--cases", default=",".join(all_cases), help=f"comma-separated subset of {','.join(all_cases)}")
    p.add_argument("--timeout", type=float, default=280)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pp-worker", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--pipeline-rss", action="store_true", help="the pipeline resident-memory table instead")
    p.add_argument("--layers", type=int, default=16, help="--pipeline-rss: MLP layers")
    p.add_argument("--width", type=int, default=2048, help="--pipeline-rss: MLP width (16 x 2048: 256 MiB)")
    args = p.parse_args()
    if args.pipeline_rss:
        from _pipeline_rss import run

        figures = run(args.layers, args.width, Path(tempfile.mkdtemp(prefix="smp_pipeline_rss_")), args.timeout)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return None
    if args.worker:
        return worker(args)
    if args.pp_worker:
        return pp_worker(args.pp_worker, args.shard)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - set(all_cases)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; choose from {all_cases}")
    out_root = Path(tempfile.mkdtemp(prefix="smp_memory_"))
    started = time.time()
    print(f"# per-rank memory: GPT-2 {MODEL}, seq {SEQ}, per-rank batch {PER_RANK_BATCH}, microbatches "
          f"{MICROBATCHES}, fp32, AdamW; counted after the 3rd step function, before optimizer.step()")
    print("# MiB per rank (max over ranks); ratio = held / ideal")
    print()
    print("| mode | procs | params (ideal) | ratio | grads (ideal) | ratio | optimizer (ideal) | ratio | buffers | other |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    figures, notes = {}, []
    for case in cases:
        if case in PP_CASES:
            row, note, figures[case] = pp_row(*PP_CASES[case], out_root, args.timeout)
            print(row, flush=True)
            notes.append(note)
            continue
        options, nprocs, label = CASES[case]
        results = run_ranks(Path(__file__).resolve(), nprocs, ["--worker", "--options", json.dumps(options)],
                            out_root / case, timeout=args.timeout)
        r0 = results[0]
        cells, ratio = held_against_ideal(results, ideal(r0))
        figures[case] = {"ranks": results, "ratio": ratio}
        row = [label, str(nprocs), *cells, mib(max(r["held"].get("buffers", 0) for r in results)),
               mib(max(r["held"].get("other", 0) for r in results))]
        print("| " + " | ".join(row) + " |", flush=True)
        if r0["held"].get("other_names"):
            notes.append(f"{label}: other = DeepSpeed optimizer attributes " + ", ".join(
                f"{k} {v / 2**20:.2f} MiB" for k, v in r0["held"]["other_names"].items()))
        if r0["zero_stage"] == 3:
            notes.append(f"{label}: stage3_param_persistence_threshold={r0['persistence_threshold']}, "
                         f"hpZ partition size {r0['hpz']}, reduce bucket {r0['reduce_bucket_size']} elements")
        if r0["tp"] > 1:
            notes.append(f"{label}: split parameters {r0['split_local_bytes'] / 2**20:.2f} MiB per rank; all local "
                         f"parameters {r0['local_param_bytes'] / 2**20:.2f} MiB; full model {r0['total_bytes'] / 2**20:.2f} MiB")
    print()
    gpt = [c for c in cases if c in CASES]
    if gpt:
        total = figures[gpt[0]]["ranks"][0]
        print(f"# full model: {total['total_params']} parameters = {total['total_bytes'] / 2**20:.2f} MiB fp32")
    for n in notes:
        print(f"# {n}")
    print(f"# wall time {time.time() - started:.0f} s; rank logs under {out_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
