"""Layouts across a slow link between nodes: the same smp v1 script (benchmarks/_cluster_mlp.py, an MLP of
3.4M parameters) on a cluster inside this machine (scripts/netns_cluster.py: 2 namespaced nodes x 2 ranks,
each node's link shaped by tbf, 100 Mbit/s by default), one job per layout per round, through ``smp-adapter
launch --launcher torchrun`` on every node. Per layout: the step time (median over the job's timed steps,
then the median over paired rounds, and its ratio to ZeRO-3's in the same round) and the bytes that crossed
the link per step, read from the kernel's counters of each node's veth (/sys/class/net/eth0/statistics/
tx_bytes inside its namespace) while the job waits before and after its timed steps: frames as sent, TCP/IP
headers included, not smp-adapter's own bookkeeping. Root and iproute2 needed (docs/cluster.md); run it when
nothing else runs on the machine.

    sudo .venv/bin/python benchmarks/cluster_comm.py                       # ~10 min on 2 cores
    sudo .venv/bin/python benchmarks/cluster_comm.py --rounds 1 --steps 2 --layouts zero3,ddp
    sudo .venv/bin/python benchmarks/cluster_comm.py --layout 'mics={"ddp": true, "sharded_data_parallel_degree": 2}'
    sudo .venv/bin/python benchmarks/cluster_comm.py --model gpt2 --plan    # plan's predictions beside the runs

``--model gpt2`` trains the Hugging Face GPT-2 of benchmarks/_cluster_gpt2.json (5.3M parameters, sequence 64)
instead of the MLP; ``--plan`` (with it) describes this cluster to ``smp-adapter plan`` (2 nodes of
``--per-node`` ranks, the intra- and inter-node TCP throughput measured on the namespaces, the fp32 matmul rate
one rank gets while every rank of the job computes, gloo's collectives) and prints plan's step time and
link bytes per node beside the measured ones for each layout.

A layout is a name, the smp options that select it and, for 1 < sdp < rdp, the engine that runs it (``LAYOUTS``:
MiCS on FSDP2, the default, or ZeRO-3 + hpZ); ``--layout NAME=JSON`` adds one from the command line (its engine:
this shell's SMP_ADAPTER_SDP_ENGINE)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import netns_cluster  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "_cluster_mlp.py"
GPT2_CONFIG = ROOT / "benchmarks" / "_cluster_gpt2.json"
GPT2 = {"batch": 8, "seq_len": 64}  # per rank, per step
# every matrix sharded (smp's default threshold, 1e6 elements, would keep this model's matrices whole: ZeRO-3
# would gather nothing); as benchmarks/_common.py's SDP
SDP = {"sdp_param_persistence_threshold": 10_000}
LAYOUTS = {  # name -> (smp options, what it is, the adapter's SMP_ADAPTER_SDP_ENGINE for sdp < rdp)
    "zero3": ({"ddp": True, "sharded_data_parallel_degree": 4, **SDP}, "ZeRO-3, sdp 4 = rdp", "mics"),
    "mics": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP}, "sdp 2 of rdp 4, MiCS on FSDP2", "mics"),
    "hpz": ({"ddp": True, "sharded_data_parallel_degree": 2, **SDP}, "sdp 2 of rdp 4, ZeRO-3 + hpZ", "hpz"),
    "ddp": ({"ddp": True}, "plain ddp (ZeRO 0)", "mics"),
}
REFERENCE = "zero3"  # ratios are to this layout's step time in the same round


def run_job(cluster, options: dict, out: Path, args, sdp_engine: str = "mics") -> dict:
    """One job; its step times and the link bytes of its timed steps."""
    out.mkdir(parents=True, exist_ok=True)
    sync = out / "sync"
    sync.mkdir()
    env = {"BENCH_OUT": str(out), "BENCH_SYNC": str(sync), "SMP_ADAPTER_SDP_ENGINE": sdp_engine}
    ledger = ["--comm-ledger", out / "ledger"] if args.ledger else []
    model = (["--hf-config", GPT2_CONFIG, "--per-rank-batch", GPT2["batch"], "--seq-len", GPT2["seq_len"]]
             if args.model == "gpt2" else [])
    runs = cluster.launch(["--nproc-per-node", args.per_node, "--grace", 5, "--options", json.dumps(options), *ledger,
                           SCRIPT, "--steps", args.steps, "--warmup", args.warmup, *model], port=29400,
                          out_dir=out / "nodes", env=env)
    nodes = range(len(cluster.nodes))

    def await_file(name: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not (sync / name).exists():
            if time.monotonic() > deadline or any(r.proc.poll() not in (None, 0) for r in runs):
                cluster.wait(runs, 1)
                raise RuntimeError(f"the job did not reach {name!r}:\n" + "\n".join(r.err[-3000:] for r in runs))
            time.sleep(0.05)

    await_file("start", args.timeout)
    before = [cluster.tx_bytes(n) for n in nodes]
    (sync / "go").write_text("")
    await_file("end", args.timeout)
    after = [cluster.tx_bytes(n) for n in nodes]
    (sync / "ack").write_text("")
    if not cluster.wait(runs, 120) or any(r.proc.returncode for r in runs):
        raise RuntimeError("the job failed:\n" + "\n".join(r.err[-3000:] for r in runs))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(cluster.nodes) * args.per_node)]
    sent = [a - b for a, b in zip(after, before)]
    result = {"step_s": statistics.median(ranks[0]["step_s"]), "steps": ranks[0]["step_s"], "params": ranks[0]["params"],
              "link_bytes_per_step": sum(sent) / args.steps, "sent_per_node": sent}
    if args.ledger:  # what smp-adapter's ledger books as inter-node per step (all ranks summed), beside the wire
        sys.path.insert(0, str(ROOT / "adapter"))
        from smp_adapter.ledger.summary import read_ledger, summarise

        per_step = summarise(read_ledger(out / "ledger"))["per_step"]
        result["ledger_inter_node_bytes_per_step"] = sum(b for (_, link, _), (_, b) in per_step.items()
                                                         if link == "inter-node")
    return result


FLOPS_PROBE = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
for _ in range(3):
    a @ b
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[1]):
    a @ b
    n += 1
print(2 * 1024 ** 3 * n / (time.perf_counter() - t0))
"""


def matmul_flops(processes: int, seconds: float = 3.0) -> float:
    """fp32 FLOP/s of one process multiplying 1024 x 1024 matrices while ``processes`` do so at once (the
    job's ranks share this machine's cores as they do): the median over the processes."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", FLOPS_PROBE, str(seconds)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(processes)]
    return statistics.median(float(p.communicate(timeout=120)[0]) for p in procs)


STEP_PROBE = """
import statistics, sys, time, torch
torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randint(0, config.vocab_size, (int(sys.argv[2]), int(sys.argv[3])))
times = []
for _ in range(8):
    t0 = time.perf_counter()
    optimizer.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - t0)
print(statistics.median(times[2:]))
"""


def model_step_seconds(processes: int) -> float:
    """One rank's compute alone: the GPT-2's training step (forward, backward, SGD) of a rank's batch in one
    process, no communication, while ``processes`` run it at once (as the job's ranks share the cores): the
    median over the processes. What plan's compute term predicts."""
    import subprocess

    argv = [sys.executable, "-c", STEP_PROBE, str(GPT2_CONFIG), str(GPT2["batch"]), str(GPT2["seq_len"])]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(processes)]
    return statistics.median(float(p.communicate(timeout=300)[0]) for p in procs)


def plan_prediction(options: dict, engine: str, args, hardware: dict) -> dict:
    """``smp-adapter plan --json`` for one layout on the cluster described by ``hardware``."""
    import subprocess

    argv = [sys.executable, "-m", "smp_adapter.cli", "plan", json.dumps(options), "--model", str(GPT2_CONFIG),
            "--batch-size", str(GPT2["batch"]), "--seq-len", str(GPT2["seq_len"]), "--optimizer", "sgd",
            "--instance-count", "2", "--gpus-per-node", str(args.per_node), "--gpu-memory", "8",
            "--intra-node-bandwidth", f"{hardware['intra_node_GBps']:.6g}",
            "--inter-node-bandwidth", f"{hardware['inter_node_GBps']:.6g}",
            "--gpu-flops", f"{hardware['flops'] / 1e12:.6g}", "--collectives", "gloo", "--json"]
    env = {**os.environ, "SMP_ADAPTER_SDP_ENGINE": engine, "PYTHONPATH": str(ROOT / "adapter")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode:
        raise RuntimeError(f"plan failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="each node's link (tc units; default 100mbit)")
    p.add_argument("--per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per job (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--layout", action="append", default=[], metavar="NAME=JSON", help="another layout: its smp options")
    p.add_argument("--ledger", action="store_true", help="also run the communication ledger (--comm-ledger) and "
                   "print its inter-node bytes per step beside the link's")
    p.add_argument("--timeout", type=float, default=600, help="seconds a job may take to reach each handover")
    p.add_argument("--out", default="/tmp/cluster_comm", help="job folders and results.json")
    p.add_argument("--model", choices=("mlp", "gpt2"), default="mlp",
                   help="mlp: the 3.4M-parameter MLP (default); gpt2: benchmarks/_cluster_gpt2.json, which plan reads")
    p.add_argument("--plan", action="store_true", help="with --model gpt2: plan's predictions beside the measurements")
    args = p.parse_args(argv)
    if args.plan and args.model != "gpt2":
        p.error("--plan needs --model gpt2 (plan reads a Hugging Face config; the MLP is not one)")
    reason = netns_cluster.unavailable()
    if reason:
        print(f"cluster_comm: {reason}", file=sys.stderr)
        return 3
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",") if name}
    for item in args.layout:
        name, _, options = item.partition("=")
        layouts[name] = (json.loads(options), name, os.environ.get("SMP_ADAPTER_SDP_ENGINE", "mics"))
    out = Path(args.out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    with netns_cluster.Cluster(nodes=2, rate=args.rate) as cluster:
        mbit = cluster.throughput(1, 0)
        print(f"# {len(cluster.nodes)} nodes x {args.per_node} ranks, link tbf {args.rate} (burst {cluster.burst}, latency "
              f"{cluster.latency}): measured TCP throughput node 1 -> node 0 {mbit:.1f} Mbit/s; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        hardware = {}
        if args.plan:
            world = len(cluster.nodes) * args.per_node
            hardware = {"inter_node_GBps": netns_cluster.rate_bits(args.rate) / 8e9,
                        "intra_node_GBps": cluster.throughput(0, 0) / 8e3, "flops": matmul_flops(world),
                        "model_step_s": model_step_seconds(world)}
            print(f"# described to plan: inter-node {hardware['inter_node_GBps'] * 8e3:.1f} Mbit/s (the link's rate), "
                  f"intra-node (a node's loopback, measured) {hardware['intra_node_GBps'] * 8e3:.0f} Mbit/s, "
                  f"{hardware['flops'] / 1e9:.1f} GFLOP/s fp32 per rank (a 1024 x 1024 matmul, {world} processes at "
                  f"once); measured beside it: the model's step alone in one process, {world} at once: "
                  f"{hardware['model_step_s']:.3f} s", flush=True)
        for rnd in range(args.rounds):
            for name, (options, _, engine) in layouts.items():
                res = run_job(cluster, options, out / f"r{rnd}" / name, args, engine)
                results[name].append(res)
                booked = (f"  ledger inter-node {res['ledger_inter_node_bytes_per_step'] / 1e6:.2f} MB/step"
                          if args.ledger else "")
                print(f"round {rnd} {name:8s} step {res['step_s']:.3f} s  link {res['link_bytes_per_step'] / 1e6:.2f} MB/step"
                      f"{booked}  steps {[round(s, 3) for s in res['steps']]}", flush=True)
    print(f"\n| layout | options | step time (median of {args.rounds} rounds) | / {REFERENCE} (paired, median) | "
          "link bytes per step (both nodes' veth tx) | per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    world = 2 * args.per_node
    for name, (options, what, _) in layouts.items():
        runs = results[name]
        ratio = ""
        if REFERENCE in results and name != REFERENCE:
            ratio = f"{statistics.median(r['step_s'] / ref['step_s'] for r, ref in zip(runs, results[REFERENCE])):.2f}"
        link = statistics.median(r["link_bytes_per_step"] for r in runs)
        print(f"| {name} ({what}) | `{json.dumps(options)}` | {statistics.median(r['step_s'] for r in runs):.3f} s | "
              f"{ratio or '1'} | {link / 1e6:.2f} MB | {link / world / 1e6:.2f} MB |")
    predictions = {}
    if args.plan:
        print("\n| layout | measured step | plan's step (compute + exposed communication) | plan / measured | "
              "link bytes per node per step, measured | plan's | plan / measured |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, (options, what, engine) in layouts.items():
            plan = predictions[name] = plan_prediction(options, engine, args, hardware)
            step = statistics.median(r["step_s"] for r in results[name])
            link = statistics.median(r["link_bytes_per_step"] for r in results[name]) / len(cluster.nodes)
            predicted = plan["link_bytes_per_node_per_step"]
            print(f"| {name} ({what}) | {step:.3f} s | {plan['step_time_s']:.3f} s ({plan['compute_s']:.3f} + "
                  f"{plan['exposed_comm_s']:.3f}) | {plan['step_time_s'] / step:.2f} | {link / 1e6:.2f} MB | "
                  f"{predicted / 1e6:.2f} MB | {predicted / link if link else float('nan'):.2f} |")
        compute = next(iter(predictions.values()))["compute_s"]
        print(f"\nplan's compute term {compute:.3f} s a step; the model's step alone, measured {hardware['model_step_s']:.3f} s "
              f"(plan / measured {compute / hardware['model_step_s']:.2f})")
    (out / "results.json").write_text(json.dumps({"throughput_mbit": mbit, "hardware": hardware, "results": results,
                                                  "plan": predictions}, indent=1))
    print(f"\n# parameters {results[next(iter(results))][0]['params']:,}; results in {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
