"""The job the namespaced-cluster tests run (Slurm, sshd: test_slurm_cluster.py, test_sshd_cluster.py) and its
one-node reference: tp 2 x dp 2 of train_tp.py on one node of 4 ranks, computed once per test session, also
across pytest-xdist workers (launch_util.shared_results)."""

from __future__ import annotations

import json

from launch_util import ROOT, results_as_launched, shared_results

TP = ROOT / "tests/distributed/scripts/train_tp.py"
TP_DP = {"ddp": True, "tensor_parallel_degree": 2}


def one_node_results(tmp_path_factory) -> list[dict]:
    def compute():
        cwd = tmp_path_factory.mktemp("one_node")
        return results_as_launched("--launcher", "torchrun", "--cpu", "--nproc-per-node", 4, "--options",
                                   json.dumps(TP_DP), "--job-dir", cwd / "job", TP, cwd=cwd, timeout=150)

    return shared_results(tmp_path_factory, "tp2_dp2_one_node", compute)
