"""plan on a cluster of CPU ranks (``--collectives gloo``), the way benchmarks/cluster_comm.py --plan
describes the namespaced cluster: the bytes each node's link carries against the ring arithmetic done
by hand from the parameter count, gloo's reduce_scatter at an all-reduce's cost (what the veth counters
showed, RESULTS.md §14), nothing hidden behind compute, and the command's text and JSON."""

import dataclasses
import json

import pytest

from smp_adapter.cli import main
from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.plan import costs, timing
from smp_adapter.plan.instances import GB, GiB, Cluster
from smp_adapter.plan.model_spec import model_spec

GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 128, "vocab_size": 8192}
SHARD_ALL = {"sdp_param_persistence_threshold": 10_000}  # every matrix sharded, as the benchmark does
CPU_CLUSTER = Cluster("custom", 2, 2, 8 * GiB, {"fp32": 20e9, "fp16": 20e9, "bf16": 20e9}, 1.5 * GB, 100e6 / 8,
                      gpu="cpu", collectives="gloo")


def _plan(options, engine="mics", cluster=CPU_CLUSTER):
    dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, **options}), 4, engine)
    return costs.plan(model_spec(GPT2, seq_len=64), dims, cluster, costs.Job(8, False, optimizer="sgd"))


def _link(plan, cluster=CPU_CLUSTER):
    return sum(timing.link_bytes_per_node(t, cluster) for t in plan.comm)


def test_gloo_reduce_scatter_costs_an_all_reduce():
    assert timing.ring_factor("reduce_scatter", 4, "gloo") == timing.ring_factor("all_reduce", 4) == 1.5
    assert timing.ring_factor("reduce_scatter", 4, "nccl") == timing.ring_factor("all_gather", 4) == 0.75


def test_link_bytes_per_node_follow_the_rings_by_hand():
    """2 nodes x 2 ranks. ZeRO-3 (sdp 4): one ring of 4 leaves each node once; the model's fp32 bytes M are
    gathered (3/4 M out of each node) and reduce-scattered at an all-reduce's cost (3/2 M). MiCS (sdp 2 of 4):
    the two replica groups (ranks 0-2, 1-3) each all-reduce a half-model shard between the nodes, each rank
    sending its shard once: 2 x M/2 out of each node. ddp: one ring all-reduce of M, 3/2 M."""
    m = model_spec(GPT2, seq_len=64).total_params * 4
    zero3 = _plan({"sharded_data_parallel_degree": 4, **SHARD_ALL})
    mics = _plan({"sharded_data_parallel_degree": 2, **SHARD_ALL})
    ddp = _plan({})
    # tolerance: padding of shards and the few persistent (never gathered) vectors, well under 1 %
    assert _link(zero3) == pytest.approx(m * (3 / 4 + 3 / 2), rel=0.01)
    assert _link(mics) == pytest.approx(2 * m / 2, rel=0.01)
    assert _link(ddp) == pytest.approx(m * 3 / 2, rel=0.01)
    nccl = dataclasses.replace(CPU_CLUSTER, collectives="nccl", gpu="")
    assert _link(_plan({"sharded_data_parallel_degree": 4, **SHARD_ALL}, cluster=nccl), nccl) == pytest.approx(
        m * (3 / 4 + 3 / 4), rel=0.01)


def test_nothing_hides_behind_compute_on_cpu_ranks():
    zero3 = _plan({"sharded_data_parallel_degree": 4, **SHARD_ALL})
    assert zero3.exposed_comm_s == pytest.approx(zero3.comm_s)
    assert zero3.step_time_s == pytest.approx(zero3.compute_s + zero3.comm_s)
    assert zero3.efficiency == timing.COMPUTE_EFFICIENCY["cpu", "fp32"] and zero3.efficiency_calibrated
    on_gpus = dataclasses.replace(CPU_CLUSTER, collectives="nccl", gpu="")
    overlapped = _plan({"sharded_data_parallel_degree": 4, **SHARD_ALL}, cluster=on_gpus)
    assert overlapped.exposed_comm_s < overlapped.comm_s


def test_the_command_describes_cpu_ranks(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    argv = ["plan", json.dumps({"ddp": True, "sharded_data_parallel_degree": 2}), "--model", str(config),
            "--batch-size", "8", "--seq-len", "64", "--optimizer", "sgd", "--instance-count", "2", "--gpus-per-node", "2",
            "--gpu-memory", "8", "--intra-node-bandwidth", "1.5", "--inter-node-bandwidth", "0.0125", "--gpu-flops", "0.02",
            "--collectives", "gloo"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "each node's network link carries" in text and "over gloo" in text
    assert f"at {timing.GLOO_COMM_EFFICIENCY:.0%} of link bandwidth" in text
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["collectives"] == "gloo"
    assert out["link_bytes_per_node_per_step"] == pytest.approx(_link(_plan({"sharded_data_parallel_degree": 2})))
