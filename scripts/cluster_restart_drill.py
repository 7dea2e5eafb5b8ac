"""A drill on the namespaced cluster (scripts/netns_cluster.py, docs/cluster.md): a node fails mid-job after a
checkpoint, the job ends on both nodes, and a manual restart on the same cluster resumes from the last good
checkpoint; its losses are compared with plain PyTorch's uninterrupted run of the same steps. Not in CI (two jobs,
~75 s on 2 cores: the suite's budget); docs/cluster.md records a run. Root and iproute2 needed.

    sudo .venv/bin/python scripts/cluster_restart_drill.py /tmp/drill

The job: tests/distributed/scripts/train_vit.py, ZeRO-3 over sdp 4 on 2 nodes x 2 ranks, Adam; a partial
checkpoint after step 2 into a directory both nodes see (a shared file system's role); rank 3 (node 1) raises at
step 4. The restart: the same command with --resume from step 2, 4 steps."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests/distributed/scripts"), str(ROOT / "tests/distributed")]
import netns_cluster  # noqa: E402

VIT = ROOT / "tests/distributed/scripts/train_vit.py"
ZERO3 = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0,
         "sdp_gradient_clipping": 0.0}


def job(cluster, work: Path, name: str, args: list, port: int) -> list:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SMP_TEST_OUT"] = str(out)  # where train_vit.py writes each rank's results
    started = time.monotonic()
    runs = cluster.launch(["--nproc-per-node", 2, "--grace", 3, "--node-timeout", 10, "--options", json.dumps(ZERO3),
                           VIT, "--optimizer", "adam", "--lr", "1e-3", "--ckpt-dir", work / "ckpt", *args],
                          port=port, out_dir=work / f"{name}-nodes")
    if not cluster.wait(runs, 300):
        raise SystemExit(f"{name}: still running after 300 s (stopped)")
    print(f"{name}: exit codes {[r.proc.returncode for r in runs]}, {time.monotonic() - started:.1f} s")
    for r in runs:
        said = [line for line in r.err.splitlines() if line.startswith("smp-adapter launch:")]
        print(f"  node {r.node.index}: {said[-1] if said else '(nothing)'}")
    return runs


def main(argv: list[str]) -> int:
    reason = netns_cluster.unavailable()
    if reason:
        print(f"cluster_restart_drill: {reason}", file=sys.stderr)
        return 3
    work = Path(argv[0] if argv else "/tmp/cluster_restart_drill")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with netns_cluster.Cluster(nodes=2, rate="1gbit") as cluster:
        failed = job(cluster, work, "first", ["--steps", 6, "--save-at", 2, "--raise-at-step", 4, "--raise-rank", 3], 29400)
        if not all(r.proc.returncode for r in failed):
            print("the first job should have failed on both nodes", file=sys.stderr)
            return 1
        resumed = job(cluster, work, "resumed", ["--steps", 4, "--first-step", 2, "--resume"], 29401)
        if any(r.proc.returncode for r in resumed):
            print(resumed[0].err[-3000:], file=sys.stderr)
            return 1
    from common import reference_losses

    losses = json.loads((work / "resumed" / "rank0.json").read_text())["losses"]
    reference, _ = reference_losses(6, 4 * 4, 1e-3, "adam")
    gap = max(abs(a - b) for a, b in zip(losses, reference[2:6]))
    print(f"resumed losses (steps 2-5) {losses}\nplain PyTorch, uninterrupted   {reference[2:6]}\nlargest gap {gap:.2e}")
    return 0 if gap < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
