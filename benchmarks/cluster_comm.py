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
    runs = cluster.launch(["--nproc-per-node", args.per_node, "--grace", 5, "--options", json.dumps(options), *ledger,
                           SCRIPT, "--steps", args.steps, "--warmup", args.warmup], port=29400, out_dir=out / "nodes",
                          env=env)
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
    args = p.parse_args(argv)
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
    (out / "results.json").write_text(json.dumps({"throughput_mbit": mbit, "results": results}, indent=1))
    print(f"\n# parameters {results[next(iter(results))][0]['params']:,}; results in {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
