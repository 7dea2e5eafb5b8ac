"""plan's communication prediction against the communication ledger of real CPU runs, per layout
and group (the runs of tests/distributed/test_comm_ledger.py: a tiny GPT-2, Adam, batch 4 per rank),
plan's memory against the peak of live tensor bytes those runs measured (the largest rank; with and
without activation checkpointing, as the test checks them), and
plan's output for seed 002's two layouts. Prints the tables benchmarks/RESULTS.md keeps.

    PYTHONPATH=adapter .venv/bin/python benchmarks/plan_accuracy.py [--layouts ddp,zero3,...]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

from smp_adapter.config.dims import ParallelDims  # noqa: E402
from smp_adapter.config.options import SMPConfig  # noqa: E402
from smp_adapter.plan import costs  # noqa: E402
from smp_adapter.plan.accuracy import compare, cpu_cluster, ledger_bytes_per_group, plan_bytes_per_group  # noqa: E402
from smp_adapter.plan.instances import instance_cluster  # noqa: E402
from smp_adapter.plan.model_spec import model_spec  # noqa: E402

VIT_002 = {"model_type": "vit", "image_size": 256, "patch_size": 16, "hidden_size": 1024, "num_hidden_layers": 50,
           "num_attention_heads": 16, "intermediate_size": 4096, "num_labels": 1000}


def main() -> None:
    from launch_util import run_ranks
    from test_comm_ledger import GPT2, LAYOUTS, STEPS, checkpointed, job_args, plan_steps

    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    spec = model_spec(dict(GPT2, model_type="gpt2"))
    print(f"{'layout':<16}{'group':<7}{'ledger B/step':>15}{'plan B/step':>13}{'error':>9}")
    memory_rows = []
    for name in args.layouts.split(","):
        options, nprocs = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            (tmp / "gpt2.json").write_text(json.dumps(GPT2))
            results = run_ranks(ROOT / "tests/distributed/scripts/ledger_job.py", nprocs, out_dir=tmp,
                                args=["--config", tmp / "gpt2.json", "--steps", STEPS, *job_args(name)],
                                env={"SM_HP_MP_PARAMETERS": json.dumps(options),
                                     "SMP_ADAPTER_COMM_LEDGER": str(tmp / "ledger")})
            records = [json.loads(line) for line in (tmp / "ledger" / "rank0.jsonl").read_text().splitlines()]
        dims = ParallelDims.from_config(SMPConfig.from_dict(options), nprocs)
        for step in plan_steps(name):  # the test's checks: step 1, and step 3 after checkpointing was turned on
            ac = checkpointed(name, step)
            planned = costs.plan(spec, dims, cpu_cluster(nprocs), costs.Job(4, activation_checkpointing=ac))
            label = name.removesuffix("_ac") + (" +AC" if ac else "")
            ledger = ledger_bytes_per_group([r for r in records if r["step"] == step], skip_first=False)
            for group, (measured, predicted, error) in compare(ledger, plan_bytes_per_group(planned)).items():
                print(f"{label:<16}{group:<7}{measured:15.0f}{predicted:13.0f}{error:+9.1%}", flush=True)
            peak = max(r["memory"]["peak_live_bytes"][str(step)] for r in results)  # the largest rank
            bucket = planned.memory.get("gradient_buckets", 0) if planned.overlap == 0 else 0
            memory_rows.append((label, peak, planned.tensor_bytes, bucket))
    print(f"\n{'layout':<16}{'measured peak B':>17}{'plan B':>14}{'error':>9}{'error without the reduce bucket':>33}")
    for name, peak, predicted, bucket in memory_rows:
        print(f"{name:<16}{peak:17d}{predicted:14d}{(predicted - peak) / peak:+9.1%}"
              f"{(predicted - peak) / (peak - bucket):+33.1%}")
    print("\nseed 002 (ViT 632M, batch 4, every layer checkpointed, Adam, fp32) on 8 x ml.g4dn.12xlarge:")
    cluster = instance_cluster("ml.g4dn.12xlarge", 8)
    times = {}
    for sdp in (32, 4):
        dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": sdp}), 32)
        p = costs.plan(model_spec(VIT_002), dims, cluster, costs.Job(4, activation_checkpointing=True))
        times[sdp] = p.step_time_s
        inter = sum(t.bytes for t in p.comm if not t.intra_node) / 1e9
        print(f"  sdp {sdp:>2}: peak {p.peak_bytes / 2**30:.2f} GiB (fits: {p.peak_bytes <= cluster.gpu_memory}), "
              f"inter-node {inter:.2f} GB/step, step {p.step_time_s:.2f} s (compute {p.compute_s:.2f}, comm {p.comm_s:.2f})")
    print(f"  predicted: sdp 4 is {times[32] / times[4] - 1:.0%} faster (step time ratio {times[32] / times[4]:.2f}); "
          "measured in the seed: ~14%")


if __name__ == "__main__":
    main()
