"""Jobs on a cluster inside this machine (scripts/netns_cluster.py, docs/cluster.md): two nodes, each a
network namespace with its own loopback and address (10.213.54.1 and .2), joined through a bridge by tbf-shaped
veth links, one ``smp-adapter launch --launcher torchrun --nnodes 2 --node-rank i --master-addr 10.213.54.1``
per node. Unlike test_multinode.py's nodes on 127.0.0.1, a rank's MASTER_ADDR is another machine's address
here, the bytes between nodes cross a link with its own counters, and a node can die or be cut off alone.

Every test checks that nothing is left afterwards: no namespace of its run in ``ip netns list``, no new
interface in this machine's namespace (``ip link``), no process inside the cluster's namespaces (found by
their inodes, so also after the names are gone). Skipped, with the tool's one-line reason, where it cannot run
(not root, no ip/tc, no namespaces)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from launch_util import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import netns_cluster  # noqa: E402

REASON = netns_cluster.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

VIT = ROOT / "tests/distributed/scripts/train_vit.py"
JOB = ROOT / "tests/distributed/scripts/cluster_job.py"
ZERO3 = {"ddp": True, "sharded_data_parallel_degree": 4, "sdp_param_persistence_threshold": 0,
         "sdp_gradient_clipping": 0.0}
PORT = 29400  # inside the cluster's own namespaces: no other job can hold it


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


@contextmanager
def cluster(**kw):
    """A cluster that the test must leave as it found the machine (checked after teardown, also on failure)."""
    links_before = _root_links()
    c = netns_cluster.Cluster(**kw)
    try:
        with c:
            yield c
    finally:
        assert c.namespaces() == [], f"namespaces left: {c.namespaces()}"
        assert c.members() == [], f"processes left in the cluster's namespaces: {c.members()}"
        assert _root_links() - links_before == set(), f"interfaces added to this machine: {_root_links() - links_before}"


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _ok(runs):
    for run in runs:
        assert run.proc.returncode == 0, f"node {run.node.index}:\n{run.out[-3000:]}\n{run.err[-3000:]}"


def test_zero3_on_two_namespaced_nodes_matches_one_process_and_crosses_the_link(tmp_path, monkeypatch):
    """The two-node torchrun job of test_multinode.py (ZeRO-3 over sdp 4, 2 ranks per node) on namespaced nodes:
    MASTER_ADDR is node 0's own address, the losses equal plain PyTorch's, and the parameter shards crossed the
    link (its veth's counters)."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("SMP_TEST_OUT", str(out))
    with cluster(nodes=2, rate="1gbit") as c:
        sent = [c.tx_bytes(0), c.tx_bytes(1)]
        runs = c.launch(["--nproc-per-node", 2, "--grace", 3, "--options", json.dumps(ZERO3), VIT,
                         "--optimizer", "adam", "--lr", "1e-3"], port=PORT, out_dir=tmp_path / "nodes")
        assert c.wait(runs, timeout=240), "the job did not end in 240 s"
        sent = [c.tx_bytes(0) - sent[0], c.tx_bytes(1) - sent[1]]
    _ok(runs)
    results = _results(out, 4)
    for rank, r in enumerate(results):
        env = r["placement"]["env"]
        assert (env["MASTER_ADDR"], env["SM_CURRENT_HOST"]) == ("10.213.54.1", f"algo-{rank // 2 + 1}")
        assert (r["placement"]["rank"], r["placement"]["local_rank"]) == (rank, rank % 2)
    from common import reference_losses

    ref, _ = reference_losses(4, 4 * results[0]["dp_size"], 1e-3, "adam")
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    # each node gathers the other node's shards every step: at least the whole model's half, several times
    half_model = results[0]["total_param_bytes"] / 2
    assert min(sent) > 4 * half_model, f"bytes sent over the links {sent}, model {2 * half_model:.0f} B"


def test_a_failing_job_ends_both_nodes_and_leaves_nothing(tmp_path, monkeypatch):
    """Rank 1 (node 1) raises at step 1: both launches exit non-zero, node 1 naming the rank and its error;
    nothing is left running, no namespace, no interface (the cluster() check)."""
    monkeypatch.setenv("SMP_TEST_OUT", str(tmp_path))
    with cluster(nodes=2, rate="1gbit") as c:
        runs = c.launch(["--nproc-per-node", 1, "--grace", 3, JOB, "--steps", 20, "--step-sleep", 0.2,
                         "--raise-rank", 1, "--raise-at-step", 1], port=PORT, out_dir=tmp_path / "nodes")
        assert c.wait(runs, timeout=120), "the failed job did not end in 120 s"
        during = [c.pids(0), c.pids(1)]
    node0, node1 = runs
    assert node1.proc.returncode == 1, node1.err[-3000:]
    assert "smp-adapter launch: rank 1 failed (exit code 1): RuntimeError: injected failure in rank 1 at step 1" \
        in node1.err
    assert node0.proc.returncode != 0, node0.err[-3000:]
    assert during == [[], []], f"processes still running in the nodes after their launches ended: {during}"
