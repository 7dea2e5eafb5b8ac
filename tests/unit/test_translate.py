"""Translation: golden files for configs/, DeepSpeed's own parser on every emitted config,
Megatron plans (checked against Megatron-core's RankGenerator), launch plans and explain rows."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.distribution import JobSpec, job_from_mapping
from smp_adapter.config.layout import VALID_ORDERS
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPConfigError
from smp_adapter.translate.deepspeed import LossScaleArgs, to_deepspeed_config
from smp_adapter.translate.explain import STATUSES, explain, format_table
from smp_adapter.launch.command import to_launch_plan
from smp_adapter.translate.megatron import TP_PP_DP_FLAG, to_megatron_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def _regen():
    spec = importlib.util.spec_from_file_location("regenerate_golden", CONFIGS / "regenerate_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGEN = _regen()
CONFIG_FILES = REGEN.config_files()


def dims_of(raw, world):
    return ParallelDims.from_config(SMPConfig.from_dict(raw), world)


# -- golden files --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_golden(path):
    golden = REGEN.GOLDEN / f"{path.stem}.json"
    assert golden.exists(), f"no golden for {path.name}: run PYTHONPATH=adapter python configs/regenerate_golden.py"
    expected, actual = golden.read_text(), REGEN.render(REGEN.golden_for(path))
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"golden/{golden.name}", "translation now", n=2))
        pytest.fail(f"translation of {path.name} differs from its golden file:\n{diff}\n"
                    "If the change is intended: PYTHONPATH=adapter python configs/regenerate_golden.py "
                    "and review git diff configs/golden")


def test_no_stale_golden_files():
    assert sorted(p.stem for p in REGEN.GOLDEN.glob("*.json")) == sorted(p.stem for p in CONFIG_FILES)


# -- DeepSpeed's parser accepts every emitted config -----------------------------------------------
@pytest.fixture(scope="module")
def ds_config_module():
    old = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"  # before the import: deepspeed picks its accelerator once
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime import config as ds_config

        get_accelerator()
    finally:
        if old is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = old
    return ds_config


class FakeMpu:
    def __init__(self, dp_world_size):
        self.dp = dp_world_size

    def get_data_parallel_world_size(self):
        return self.dp


@pytest.fixture
def parse_ds(ds_config_module, monkeypatch):
    # DeepSpeedConfig only asks the mpu for the DP world size after dist.get_rank() works;
    # without a process group it silently uses world size 1, so pretend to be rank 0.
    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *a, **k: 0)
    return lambda config, dp: ds_config_module.DeepSpeedConfig(config, mpu=FakeMpu(dp))


DS_CASES = [  # (options, world size, per-rank batch, loss scale args)
    ({}, 1, None, None),
    ({"ddp": True}, 4, 4, None),
    ({"ddp": True, "shard_optimizer_state": True}, 4, 2, None),
    ({"ddp": True, "sharded_data_parallel_degree": 4}, 4, 1, None),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, 8, 2, None),
    ({"ddp": True, "sharded_data_parallel_degree": 32, "delayed_parameter_initialization": True}, 32, 1, None),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 5e8, "sdp_param_persistence_threshold": 1000,
      "sdp_max_live_parameters": 1e8, "sdp_gradient_clipping": 0.5}, 8, 1, None),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0}, 4, 1, None),
    ({"fp16": True}, 1, 2, None),
    ({"fp16": True}, 1, 2, LossScaleArgs(static_loss_scale=128.0)),
    ({"fp16": True, "ddp": True}, 2, 2, LossScaleArgs(static_loss_scale=None, dynamic_loss_scale=True, init_scale=2**16,
                                                     scale_window=500, min_scale=1, delayed_shift=2)),
    ({"fp16_params": True, "ddp": True, "shard_optimizer_state": True}, 2, 1, LossScaleArgs(dynamic_loss_scale=True)),
    ({"bf16": True, "ddp": True}, 2, 1, None),
    ({"bf16": True, "ddp": True, "sharded_data_parallel_degree": 2}, 4, 1, None),
    ({"offload_activations": True, "microbatches": 2}, 1, 4, None),
    ({"microbatches": 8}, 1, 16, None),
    ({"pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True}, 4, 8, None),
    ({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline": "simple"}, 4, 8, None),
    ({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 4, "ddp": True,
      "placement_strategy": "spread"}, 8, 4, None),
    ({"tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True, "fp16": True}, 8, 2, None),
    ({"tensor_parallel_degree": 2, "ddp": True, "sharded_data_parallel_degree": 2, "prescaled_batch": True,
      "bf16": True}, 8, 2, None),
]


@pytest.mark.parametrize("raw,world,batch,loss", DS_CASES, ids=[f"case{i}" for i in range(len(DS_CASES))])
def test_deepspeed_parser_accepts_config(parse_ds, raw, world, batch, loss):
    dims = dims_of(raw, world)
    cfg = dims.cfg
    ds = to_deepspeed_config(dims, batch, loss)
    json.dumps(ds)  # plain JSON data
    parsed = parse_ds(ds, dims.rdp)
    per_rank = cfg.microbatches if batch is None else batch
    assert parsed.zero_optimization_stage == dims.zero_stage
    assert parsed.zero_config.zero_hpz_partition_size == dims.hpz_partition_size
    assert parsed.gradient_accumulation_steps == cfg.microbatches
    assert parsed.train_micro_batch_size_per_gpu == per_rank // cfg.microbatches
    assert parsed.train_batch_size == per_rank * dims.rdp  # micro x gas x engine DP world
    assert parsed.float16_config.enabled == cfg.fp16
    assert parsed.bfloat16_config.enabled == cfg.bf16
    assert parsed.gradient_clipping == (cfg.sdp_gradient_clipping if dims.sdp > 1 else 0.0)
    assert parsed.activation_checkpointing_config.cpu_checkpointing == cfg.offload_activations
    if dims.zero_stage == 3:
        assert parsed.zero_config.reduce_bucket_size == cfg.sdp_reduce_bucket_size
        assert parsed.zero_config.param_persistence_threshold == cfg.sdp_param_persistence_threshold
        assert parsed.zero_config.max_live_parameters == cfg.sdp_max_live_parameters
    if dims.pp > 1:
        assert parsed.pipeline["stages"] == dims.pp
    if cfg.fp16 and loss is not None:
        if loss.dynamic_loss_scale or loss.static_loss_scale is None:
            assert parsed.float16_config.loss_scale == 0  # 0 = dynamic in DeepSpeed
            assert 2 ** parsed.float16_config.initial_scale_power == loss.init_scale
            assert parsed.float16_config.loss_scale_window == loss.scale_window
        else:
            assert parsed.float16_config.loss_scale == loss.static_loss_scale


def test_fractional_min_loss_scale(parse_ds):
    dims = dims_of({"fp16": True}, 1)
    parse_ds(to_deepspeed_config(dims, None, LossScaleArgs(dynamic_loss_scale=True, min_scale=0.5)), 1)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_golden_deepspeed_configs_parse(parse_ds, path):
    golden = json.loads((REGEN.GOLDEN / f"{path.stem}.json").read_text())
    if golden["mics"] is not None:  # sdp < rdp on the MiCS engine: its settings, no DeepSpeed config
        assert golden["deepspeed"] is None
        replicate, shard = golden["mics"]["mesh"]["shape"]
        assert replicate * shard == golden["megatron"]["data_parallel_size"]  # the RDP group
        return
    parsed = parse_ds(golden["deepspeed"], golden["megatron"]["data_parallel_size"])
    assert parsed.zero_optimization_stage == golden["deepspeed"]["zero_optimization"]["stage"]


# -- Megatron plan -------------------------------------------------------------------------------
def test_megatron_plan_tp_pp():
    plan = to_megatron_plan(dims_of({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 4,
                                     "ddp": True}, 8), 8)
    assert (plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size, plan.data_parallel_size) == (2, 2, 2)
    assert (plan.order, plan.virtual_pipeline_model_parallel_size, plan.sequence_parallel) == ("tp-pp-dp", None, False)
    # dp = tp x rdp = 4 ranks (one pipeline stage) read 8 samples each -> 32 per step; a replica
    # (TP x PP group) sees 16 per step: 4 per microbatch x 4 microbatches
    assert (plan.global_batch_size, plan.micro_batch_size, plan.num_microbatches) == (32, 4, 4)
    assert plan.global_batch_size == plan.micro_batch_size * plan.num_microbatches * plan.data_parallel_size
    assert plan.to_megatron_lm_args() == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                          "--micro-batch-size", "4", "--global-batch-size", "32", TP_PP_DP_FLAG]
    assert plan.megatron_lm_note() is None


def test_megatron_plan_prescaled_batch_and_precision():
    plan = to_megatron_plan(dims_of({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True,
                                     "shard_optimizer_state": True, "bf16": True}, 8), 8)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.use_distributed_optimizer) == (32, 8, True)
    assert {"--bf16", "--use-distributed-optimizer"} <= set(plan.to_megatron_lm_args())
    fp16 = to_megatron_plan(dims_of({"fp16": True, "ddp": True, "sharded_data_parallel_degree": 2}, 2))
    assert fp16.fp16 and fp16.use_distributed_optimizer and "--fp16" in fp16.to_megatron_lm_args()


def test_megatron_plan_batch_must_split_into_microbatches():
    with pytest.raises(SMPConfigError, match=r"microbatches = 4: must divide the per-rank batch size \(6\)"):
        to_megatron_plan(dims_of({"microbatches": 4}, 1), 6)


@pytest.mark.parametrize("order", VALID_ORDERS)
@pytest.mark.parametrize("pp,tp,rdp", [(2, 2, 2), (2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 4, 1)])
def test_megatron_lm_cli_claim_matches_rank_generator(order, pp, tp, rdp):
    """The flag/note says which Megatron-LM CLI order reproduces the layout: check with RankGenerator."""
    from test_layout import _megatron  # the AST-extracted RankGenerator (no torch import)

    ps = _megatron()
    plan = to_megatron_plan(dims_of({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                                     "ddp": rdp > 1 or tp > 1, "placement_strategy": order}, pp * tp * rdp))
    grid = dims_of({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True,
                    "placement_strategy": order}, pp * tp * rdp).grid

    def same(m_order):
        gen = ps.RankGenerator(tp=tp, ep=1, dp=rdp, pp=pp, cp=1, order=m_order)
        return all(sorted(map(tuple, gen.get_ranks(t))) == sorted(grid.groups(k)) for t, k in
                   (("tp", "tp"), ("pp", "pp"), ("dp", "rdp")))

    assert same(plan.order)
    default, flagged = same("tp-cp-ep-dp-pp"), same("tp-cp-ep-pp-dp")  # Megatron-LM's two CLI orders
    flag = plan.megatron_lm_order_flag()
    assert (flag == "") == default
    assert (flag == TP_PP_DP_FLAG) == (flagged and not default)
    assert (flag is None) == (not default and not flagged)
    assert (plan.megatron_lm_note() is None) == (flag is not None)
    assert (TP_PP_DP_FLAG in plan.to_megatron_lm_args()) == (flag == TP_PP_DP_FLAG)


# -- launch plans --------------------------------------------------------------------------------
def _job(params, ppn=4, custom="", count=1) -> JobSpec:
    return job_from_mapping({"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
                             "mpi": {"enabled": True, "processes_per_host": ppn, "custom_mpi_options": custom},
                             "instance_count": count})


@pytest.mark.parametrize("custom", ["--mca btl_vader_single_copy_mechanism none",
                                    "-mca btl_vader_single_copy_mechanism none ",
                                    "--mca btl_vader_single_copy_mechanism none -mca btl_vader_single_copy_mechanism none"])
def test_mpirun_keeps_one_btl_vader_single_copy_mechanism(custom):
    plan = to_launch_plan(_job({"ddp": True}, custom=custom), None, "train.py", launcher="mpirun")
    assert plan.command.count("btl_vader_single_copy_mechanism") == 1
    i = plan.command.index("btl_vader_single_copy_mechanism")
    assert plan.command[i - 1] == "-mca" and plan.command[i + 1] == "none"
    assert any("not repeated" in n for n in plan.notes)


def test_mpirun_line():
    custom = "-mca btl ^openib,smcuda -mca btl_tcp_if_include eth0 -x FOO=1 --NCCL_DEBUG WARN --bind-to core"
    plan = to_launch_plan(_job({"ddp": True, "microbatches": 2}, ppn=4, custom=custom, count=2), None, "train.py",
                          ("--epochs", 3), launcher="mpirun", master_port=7777)
    cmd = list(plan.command)
    assert cmd[:5] == ["mpirun", "--host", "algo-1:4,algo-2:4", "-np", "8"]
    assert cmd[-4:] == ["python", "train.py", "--epochs", "3"]
    assert cmd.count("btl") == 1 and cmd[cmd.index("btl") + 1] == "^openib,smcuda"  # the user's value replaces the base
    assert ["-mca", "btl_tcp_if_include", "eth0"] == cmd[cmd.index("btl_tcp_if_include") - 1:cmd.index("btl_tcp_if_include") + 2]
    assert "NCCL_DEBUG=WARN" in cmd and "--NCCL_DEBUG" not in cmd and "FOO=1" in cmd and "--bind-to" in cmd
    for name in plan.env:
        assert cmd[cmd.index(name) - 1] == "-x"
    assert (plan.env["MASTER_ADDR"], plan.env["MASTER_PORT"], plan.world_size) == ("algo-1", "7777", 8)


def test_launch_env():
    job = _job({"tensor_parallel_degree": 2, "ddp": True, "microbatches": 2}, ppn=4, custom="-x FOO=bar --NCCL_DEBUG WARN")
    plan = to_launch_plan(job, None, "train.py", launcher="deepspeed", cpu=True)
    env = plan.env
    assert env["SM_HP_MP_PARAMETERS"] == '{"ddp":true,"microbatches":2,"tensor_parallel_degree":2}'
    assert json.loads(env["SM_FRAMEWORK_PARAMS"]) == {
        "sagemaker_distributed_dataparallel_enabled": False, "sagemaker_mpi_custom_mpi_options": "-x FOO=bar --NCCL_DEBUG WARN",
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 4}
    assert (env["SM_NUM_GPUS"], env["DS_ACCELERATOR"], env["FOO"], env["NCCL_DEBUG"]) == ("0", "cpu", "bar", "WARN")
    # what the runtime will read back is the same configuration
    assert SMPConfig.from_sources({}, environ=env) == job.config()
    gpu = to_launch_plan(job, None, "train.py", launcher="torchrun")
    assert gpu.env["SM_NUM_GPUS"] == "4" and "DS_ACCELERATOR" not in gpu.env


def test_deepspeed_command_parses_with_deepspeed_runner(ds_config_module):
    from deepspeed.launcher.runner import parse_args

    plan = to_launch_plan(_job({"ddp": True}, ppn=2), None, "train.py", ("--lr", "0.1"), cpu=True)
    assert plan.command == ("deepspeed", "--num_gpus", "2", "--master_port", "29500", "--no_local_rank", "train.py", "--lr", "0.1")
    args = parse_args(list(plan.command[1:]))
    assert (args.num_gpus, args.no_local_rank, args.user_script, args.user_args) == (2, True, "train.py", ["--lr", "0.1"])
    multi = to_launch_plan(_job({"ddp": True}, ppn=2, count=2), None, "train.py", hostfile="hosts", master_addr="10.0.0.1")
    args = parse_args(list(multi.command[1:]))
    assert (args.num_nodes, args.hostfile, args.master_addr, args.num_gpus) == (2, "hosts", "10.0.0.1", 2)


def test_torchrun_command_parses_with_torchrun():
    from torch.distributed.run import get_args_parser

    plan = to_launch_plan(_job({"ddp": True}, ppn=2), None, "train.py", launcher="torchrun", master_port=1234)
    args = get_args_parser().parse_args(list(plan.command[1:]))
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.master_port, args.training_script) == ("2", "1", 0, 1234, "train.py")
    multi = to_launch_plan(_job({"ddp": True}, ppn=2, count=3), None, "t.py", launcher="torchrun")
    assert "--node_rank ${NODE_RANK}" in multi.shell() and "--master_addr algo-1" in multi.shell()


def test_launch_world_is_validated():
    with pytest.raises(SMPConfigError, match=r"tensor_parallel_degree = 4: .*does not divide the number of processes \(6\)"):
        to_launch_plan(_job({"tensor_parallel_degree": 4, "ddp": True}, ppn=6), None, "train.py")
    with pytest.raises(SMPConfigError, match=r"ddp = False: must be true when there is more than one model replica"):
        to_launch_plan(_job({}, ppn=2), None, "train.py")
    with pytest.raises(SMPConfigError, match=r"launcher = 'pbsdsh': .*Available: deepspeed, torchrun, mpirun, srun"):
        to_launch_plan(_job({"ddp": True}), None, "train.py", launcher="pbsdsh")
    with pytest.raises(SMPConfigError, match=r"processes_per_host = 0: must be an integer >= 1"):
        to_launch_plan(_job({"ddp": True}), None, "train.py", nprocs_per_node=0)


def test_srun_line_and_its_note():
    plan = to_launch_plan(_job({"ddp": True, "tensor_parallel_degree": 2}, ppn=4), None, "train.py", launcher="srun",
                          nnodes=2, master_port=29511, python="/venv/bin/python")
    assert list(plan.command) == ["srun", "--nodes", "2", "--ntasks-per-node", "4", "--kill-on-bad-exit=1", "--label",
                                  "--export=ALL", "/venv/bin/python", "train.py"]
    assert plan.env["MASTER_PORT"] == "29511" and "MASTER_ADDR" not in plan.env  # the ranks read the nodelist
    assert plan.notes == ("srun runs inside a Slurm allocation (salloc, or an sbatch script with --nodes=2 "
                          "--ntasks-per-node=4)",)


def test_process_counts_and_ports():
    plain = JobSpec(options={"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": True,
                             "ddp_port": 4000})
    plan = to_launch_plan(plain, None, "train.py", launcher="torchrun")  # smallest world: pp x tp x sdp = 4
    assert (plan.nprocs_per_node, plan.nnodes, plan.command[plan.command.index("--master_port") + 1]) == (4, 1, "4000")
    override = to_launch_plan(_job({"ddp": True}, ppn=8), None, "train.py", nprocs_per_node=2)
    assert override.command[:3] == ("deepspeed", "--num_gpus", "2")


# -- explain -------------------------------------------------------------------------------------
def test_explain_covers_given_keys_and_derived_settings():
    job = _job({"ddp": True, "sharded_data_parallel_degree": 2, "skip_tracing": True, "partitions": 1,
                "sdp_hierarchical_allgather": False, "bf16": True}, ppn=8, custom="--mca btl_vader_single_copy_mechanism none")
    dims = ParallelDims.from_config(job.config(), 8, "hpz")  # SMP_ADAPTER_SDP_ENGINE=hpz (MiCS: below)
    ds, plan = to_deepspeed_config(dims), to_megatron_plan(dims)
    rows = explain(job, dims, ds, plan)
    by_key = {r.key: r for r in rows}
    mics_dims = ParallelDims.from_config(job.config(), 8)
    mics = {r.key: r for r in explain(job, mics_dims, to_deepspeed_config(mics_dims), to_megatron_plan(mics_dims))}
    assert mics["sharded_data_parallel_degree"].status == "exact" and "MiCS" in mics["sharded_data_parallel_degree"].engine_key
    assert mics["(derived) sdp engine"].value == "mics" and "(derived) hpZ partition" not in mics
    assert mics["sdp_hierarchical_allgather"].status == "ignored" and "inside its group" in mics["sdp_hierarchical_allgather"].note
    assert by_key["(derived) sdp engine"].value == "hpz"
    assert set(job.options) <= set(by_key)
    assert {r.status for r in rows} <= set(STATUSES)
    assert by_key["skip_tracing"].status == "ignored" and "does not trace" in by_key["skip_tracing"].note
    assert by_key["sharded_data_parallel_degree"].status == "approximated" and "hpZ" in by_key["sharded_data_parallel_degree"].note
    assert by_key["partitions"].engine_value == 1 and "pipeline_parallel_degree" not in by_key  # alias shown once
    assert by_key["(derived) ZeRO stage"].engine_value == 3 and by_key["(derived) hpZ partition"].engine_value == 2
    assert by_key["(derived) global batch"].engine_value == plan.global_batch_size
    assert by_key["bf16"].status == "exact" and by_key["fp16"].status == "default"
    assert by_key["mpi.custom_mpi_options"].status == "approximated"
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["smp", "key"] and len(lines) == len(rows) + 2
    assert all(line == line.rstrip() for line in lines)


def test_explain_from_config_alone():
    cfg = SMPConfig.from_dict({"microbatches": 2, "pipeline": "simple", "pipeline_parallel_degree": 2})
    dims = ParallelDims.from_config(cfg, 2)
    rows = explain(cfg, dims, to_deepspeed_config(dims), to_megatron_plan(dims))
    by_key = {r.key: r for r in rows}
    assert by_key["pipeline"].status == "approximated" and by_key["pipeline"].source == "given"
    assert by_key["active_microbatches"].engine_value == 2


def test_docs_mapping_table_names_the_deepspeed_entries_the_emitter_writes():
    """One home for the smp -> DeepSpeed mapping: DEEPSPEED_KEYS. The docs' table must name every
    entry it lists for a key, and every listed entry must be one the emitter can write."""
    from pathlib import Path

    from smp_adapter.translate.deepspeed import DEEPSPEED_KEYS, deepspeed_value

    table = (Path(__file__).resolve().parents[2] / "docs" / "translation.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in table.splitlines() if line.startswith("| `")}
    for key, paths in DEEPSPEED_KEYS.items():
        assert f"`{key}`" in rows, f"docs/translation.md has no row for {key}"
        for path in paths:
            assert f"`{path}`" in rows[f"`{key}`"], f"the docs' DeepSpeed column for {key} does not name {path}"
    # a job that turns every mapped option on: every listed entry is in the emitted config
    options = {"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2, "bf16": True,
               "offload_activations": True}
    ds = to_deepspeed_config(ParallelDims.from_config(SMPConfig.from_dict(options), 4, "hpz"))  # DeepSpeed runs it
    missing = [p for key, paths in DEEPSPEED_KEYS.items() for p in paths
               if deepspeed_value(ds, p) is None and key not in ("pipeline_parallel_degree", "fp16")]
    assert missing == []


def test_dynamic_loss_args_defaults_are_loss_scale_args_defaults():
    from dataclasses import fields

    from smp_adapter.translate.deepspeed import DEFAULT_DYNAMIC_LOSS_ARGS

    assert LossScaleArgs(**DEFAULT_DYNAMIC_LOSS_ARGS) == LossScaleArgs()
    assert set(DEFAULT_DYNAMIC_LOSS_ARGS) == {f.name for f in fields(LossScaleArgs)} - {"static_loss_scale",
                                                                                        "dynamic_loss_scale"}


def test_docs_mapping_table_follows_the_engines_key_tables():
    """Each key an engine's table (or the shared one) gives a meaning has a row in docs/translation.md, and
    each fixed status a table row gives (ignored aside: the notes say when) is in that row's status cell."""
    import re
    from pathlib import Path

    from smp_adapter.translate.explain import ENGINE_KEYS
    from smp_adapter.translate.key_meanings import EVERY_ENGINE_KEYS, Meaning

    text = (Path(__file__).resolve().parents[2] / "docs" / "translation.md").read_text()
    table = text.split("## 1. Mapping table")[1].split("\n## ")[0]
    status_of = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            for key in re.findall(r"`([^`]+)`", cells[1]):
                status_of[key] = cells[5]
    for name, rows in [*ENGINE_KEYS.items(), ("every engine", EVERY_ENGINE_KEYS)]:
        for key, row in rows.items():
            assert key in status_of, f"docs/translation.md has no row for {key} ({name} table)"
            if isinstance(row, Meaning) and row.status != "ignored":
                assert row.status in status_of[key], f"{key} is {row.status} on {name}; docs say {status_of[key]}"


@pytest.mark.parametrize("options,world,engine_value,words", [
    ({"ddp": True, "sharded_data_parallel_degree": 2}, 2, "recorded; materialised module by module into ZeRO-3 shards",
     "one module's whole tensors"),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, 4, "recorded; materialised tensor by tensor into FSDP2 shards",
     "plus one whole tensor"),
    ({"pipeline_parallel_degree": 2, "microbatches": 2}, 2, "recorded; each stage materialised on its rank",
     "its own stage(s) only"),
    ({"ddp": True, "tensor_parallel_degree": 2}, 4, "recorded; materialised by DistributedModel", "only its slices"),
    ({"ddp": True}, 2, "recorded; materialised by DistributedModel", "saves the host copy only"),
])
def test_explain_says_what_delayed_init_does_on_each_layout(options, world, engine_value, words):
    """The row is what the engine of that layout does (runtime/engines: module_init_context and
    materialize_kept), not one sentence for every layout."""
    cfg = SMPConfig.from_dict({**options, "delayed_parameter_initialization": True})
    dims = ParallelDims.from_config(cfg, world)
    rows = {r.key: r for r in explain(cfg, dims, to_deepspeed_config(dims), to_megatron_plan(dims))}
    row = rows["delayed_parameter_initialization"]
    assert row.engine_value == engine_value and words in row.note and row.status == "exact"
