"""plan for a user leaving SageMaker (issue 66): node presets (--node), one's own nodes in YAML
(--cluster FILE), help text for every flag, and --explain's per-phase account."""

import argparse
import json

import pytest

from smp_adapter.cli import main
from smp_adapter.commands import plan as plan_command
from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.plan import costs
from smp_adapter.plan.cluster_file import read_cluster_file
from smp_adapter.plan.input_errors import PlanInputError
from smp_adapter.plan.instances import NODE_PRESETS, instance_cluster, node_cluster
from smp_adapter.plan.model_spec import model_spec

VIT = {"model_type": "vit", "image_size": 256, "patch_size": 16, "hidden_size": 1024, "num_hidden_layers": 50,
       "num_attention_heads": 16, "intermediate_size": 4096, "num_labels": 1000}


def _step(cluster, sdp=32):
    dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": sdp}),
                                    cluster.world_size)
    return costs.plan(model_spec(VIT), dims, cluster, costs.Job(4, True)).step_time_s


def test_every_flag_has_help_text():
    parser = plan_command.add_parser(argparse.ArgumentParser().add_subparsers())
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings or action.dest


def test_a_t4_preset_is_the_g4dn_node_it_describes():
    """4xT4-PCIe states g4dn.12xlarge's figures (4 T4 on PCIe 3, 50 Gbit/s), so plans agree; host memory
    is not known for a generic PCIe node."""
    preset, g4dn = node_cluster("4xT4-PCIe", 8), instance_cluster("ml.g4dn.12xlarge", 8)
    assert _step(preset) == _step(g4dn)
    assert preset.host_memory == 0 < g4dn.host_memory


def test_sxm_presets_link_class_and_latency():
    h100 = node_cluster("8xH100-SXM", 2)
    assert h100.gpus_per_node == 8 and h100.inter_node_bandwidth == 3200e9 / 8
    assert h100.intra_node_latency < node_cluster("8xL4-PCIe", 2).intra_node_latency  # NVLink's hop is shorter
    with pytest.raises(PlanInputError, match="did you mean 8xH100-SXM"):
        node_cluster("8xH100-SMX", 1)


def test_a_cluster_file_from_scratch_equals_the_preset_it_restates(tmp_path):
    path = tmp_path / "nodes.yaml"
    path.write_text("nodes: 2\ngpus_per_node: 8\ngpu: H100-SXM-80GB\nintra_node: nvlink\nintra_node_gbytes: 450\n"
                    "inter_node_gbit: 3200\nhost_memory_gib: 2048\n")
    mine, preset = read_cluster_file(str(path)), node_cluster("8xH100-SXM", 2)
    for field in ("gpus_per_node", "nodes", "gpu_memory", "usable_memory", "flops", "intra_node_bandwidth",
                  "inter_node_bandwidth", "host_memory", "gpu", "call_latency", "intra_node_latency",
                  "inter_node_latency"):
        assert getattr(mine, field) == getattr(preset, field), field


def test_a_cluster_file_overrides_its_base_and_the_command_line_count_wins(tmp_path):
    path = tmp_path / "nodes.yaml"
    path.write_text("base: ml.g4dn.12xlarge\nnodes: 4\ninter_node_gbit: 100\nlatency_us: {inter_node: 50}\n")
    cluster = read_cluster_file(str(path), nodes=8)
    assert cluster.nodes == 8 and cluster.inter_node_bandwidth == 100e9 / 8
    assert cluster.inter_node_latency == pytest.approx(50e-6)
    assert _step(cluster) < _step(instance_cluster("ml.g4dn.12xlarge", 8))  # a faster network


@pytest.mark.parametrize("text, message", [
    ("base: 4xT4-PCIe\nnodse: 2\n", "nodse = 2: is not a key plan reads. Fix: did you mean nodes?"),
    ("gpus_per_node: 8\ngpu: H100\nintra_node_gbytes: 450\ninter_node_gbit: 400\n", "gpu = 'H100': is not a GPU"),
    ("gpus_per_node: 8\ntflops: 100\nintra_node_gbytes: 32\ninter_node_gbit: 100\n", "gpu_memory_gib: is missing"),
    ("base: 4xT4-PCIe\ngpus_per_node: -1\n", "gpus_per_node = -1: must be a positive integer"),
    ("- a list\n", "is not a mapping"),
])
def test_a_bad_cluster_file_gets_its_own_message(tmp_path, text, message):
    path = tmp_path / "nodes.yaml"
    path.write_text(text)
    with pytest.raises(PlanInputError) as info:
        read_cluster_file(str(path))
    assert str(info.value).startswith("cluster file: ") and message in str(info.value)


def _cli(tmp_path, capsys, *extra, options='{"ddp": true, "sharded_data_parallel_degree": 4}'):
    model = tmp_path / "vit.json"
    model.write_text(json.dumps(VIT))
    code = main(["plan", options, "--model", str(model), "--batch-size", "4", "--activation-checkpointing", *extra])
    return code, capsys.readouterr()


def test_explain_accounts_for_every_exposed_second(tmp_path, capsys):
    """--json's phases: each window's exposed part is its busiest link's excess over its compute, and
    they and the critical path add up to the step's exposed communication."""
    code, out = _cli(tmp_path, capsys, "--node", "4xT4-PCIe", "--nodes", "8", "--json")
    assert code == 0, out.err
    data = json.loads(out.out)
    phases = data["phases"]
    for name, p in phases.items():
        if name != "critical_path":
            assert p["exposed_s"] == pytest.approx(max(0.0, max(p["comm_s_by_link"].values()) - p["compute_s"]))
    assert sum(p["exposed_s"] for p in phases.values()) == pytest.approx(data["exposed_comm_s"])
    assert phases["last_backward"]["exposed_s"] > 0  # MiCS's replica all-reduce outruns the last backward
    code, out = _cli(tmp_path, capsys, "--node", "4xT4-PCIe", "--nodes", "8", "--explain")
    assert code == 0 and "last_backward" in out.out and "shows" in out.out


def test_two_hardware_descriptions_are_refused(tmp_path, capsys):
    code, out = _cli(tmp_path, capsys, "--node", "4xT4-PCIe", "--instance-type", "ml.g4dn.12xlarge")
    assert code == 2 and "cannot be combined with --instance-type" in out.err
