"""smp options -> SMPConfig -> ParallelDims: the policy table, type rules, spec §5 cases,
distribution dicts and the degree arithmetic (spec §1, design §2)."""

from __future__ import annotations

import json

import pytest

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.distribution import job_from_mapping, load_job
from smp_adapter.config.keys import KEYS, Policy
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPConfigError

# Hard-coded from spec §1.3 (the four v1 tables + "keys seen in public material") and §4 (v2 keys).
# A key missing from the policy table must fail here, not be noticed by a user.
SPEC_V1_KEYS = [
    # parallelism degrees and pipeline
    "pipeline_parallel_degree", "partitions", "tensor_parallel_degree", "microbatches", "pipeline",
    "active_microbatches", "placement_strategy", "auto_partition", "default_partition", "optimize",
    "memory_weight", "skip_tracing", "deterministic_server", "contiguous", "horovod",
    # data parallelism / process groups
    "ddp", "ddp_port", "ddp_dist_backend",
    # memory saving
    "shard_optimizer_state", "offload_activations", "activation_loading_horizon",
    "delayed_parameter_initialization", "prescaled_batch",
    # mixed precision
    "fp16", "bf16", "fp16_params",
    # sharded data parallel
    "sharded_data_parallel_degree", "sdp_reduce_bucket_size", "sdp_param_persistence_threshold",
    "sdp_max_live_parameters", "sdp_hierarchical_allgather", "sdp_gradient_clipping",
    # seen in public material, not documented
    "fast_mode", "static_mode", "load_partition", "partition_file", "_match_weights", "_fp32_grad_accumulation",
]
SPEC_V2_ONLY_KEYS = ["hybrid_shard_degree", "sm_activation_offloading", "fsdp_cache_flush_warnings",
                     "allow_empty_shards", "context_parallel_degree", "expert_parallel_degree", "random_seed"]
IGNORED_KEYS = {"skip_tracing": True, "deterministic_server": True, "contiguous": False, "fast_mode": True,
                "static_mode": True, "load_partition": True, "partition_file": "p.txt",
                "activation_loading_horizon": 2, "sdp_hierarchical_allgather": False, "_match_weights": True,
                "_fp32_grad_accumulation": True}


# -- the policy table ---------------------------------------------------------------------------
@pytest.mark.parametrize("key", SPEC_V1_KEYS + SPEC_V2_ONLY_KEYS)
def test_policy_table_has_a_row_for_every_spec_key(key):
    assert key in KEYS, f"spec key {key!r} has no row in config/keys.py"
    row = KEYS[key]
    assert row.note, "every row says what happens to the key"
    if row.policy is Policy.ALIAS:
        assert row.alias_of in KEYS


@pytest.mark.parametrize("key", SPEC_V2_ONLY_KEYS)
def test_v2_keys_are_rejected_with_the_alternative(key):
    value = True if KEYS[key].kind == "bool" else 2
    with pytest.raises(SMPConfigError, match=rf"{key} = .*SMP v2"):
        SMPConfig.from_dict({key: value})


def test_v2_key_names_the_v1_equivalent():
    with pytest.raises(SMPConfigError, match="use sharded_data_parallel_degree"):
        SMPConfig.from_dict({"hybrid_shard_degree": 8})
    with pytest.raises(SMPConfigError, match="use offload_activations"):
        SMPConfig.from_dict({"sm_activation_offloading": True})


@pytest.mark.parametrize("key,value", sorted(IGNORED_KEYS.items()))
def test_ignored_keys_are_accepted_with_a_warning(key, value):
    cfg = SMPConfig.from_dict({key: value})
    assert any(f"'{key}' is accepted and ignored" in w for w in cfg.warnings)
    assert KEYS[key].note in " ".join(cfg.warnings)


def test_defaults_have_one_home_the_policy_table():
    """SMPConfig's defaults are keys.py's; a formula default (None in keys.py, resolved by from_dict) holds its
    value at the default options, so SMPConfig() and the default options agree."""
    from dataclasses import fields

    formula = {"virtual_pipeline_degree", "active_microbatches", "memory_weight"}
    resolved = SMPConfig.from_dict({})
    for f in fields(SMPConfig):
        if f.name in ("given", "warnings"):
            continue
        home = KEYS[f.name].default
        if f.name in formula:
            assert home is None and f.default == getattr(resolved, f.name), f.name
        else:
            assert f.default == home and type(f.default) is type(home), f"{f.name}: {f.default!r} vs keys.py {home!r}"
    assert SMPConfig() == resolved


def test_horovod_false_is_accepted_true_is_rejected():
    SMPConfig.from_dict({"horovod": False})
    with pytest.raises(SMPConfigError, match="horovod = True: .*TensorFlow-only.*ddp: true"):
        SMPConfig.from_dict({"horovod": True})


# -- aliases ------------------------------------------------------------------------------------
def test_partitions_alias_folds_into_pipeline_parallel_degree():
    cfg = SMPConfig.from_dict({"partitions": 2})
    assert cfg.pipeline_parallel_degree == 2 and cfg.partitions == 2
    assert SMPConfig.from_dict({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2


def test_partitions_disagreeing_with_pipeline_parallel_degree_is_an_error():
    with pytest.raises(SMPConfigError, match=r"partitions = 4: disagrees with pipeline_parallel_degree = 2"):
        SMPConfig.from_dict({"partitions": 4, "pipeline_parallel_degree": 2})


def test_fp16_params_turns_on_fp16():
    assert SMPConfig.from_dict({"fp16_params": True}).fp16 is True
    assert SMPConfig.from_dict({"fp16_params": False}).fp16 is False


def test_fp16_params_false_says_nothing_about_fp16():
    assert SMPConfig.from_dict({"fp16": True, "fp16_params": False}).fp16 is True


# -- type rules ---------------------------------------------------------------------------------
def test_integral_float_is_an_int():
    cfg = SMPConfig.from_dict({"sdp_reduce_bucket_size": 5e8, "sdp_max_live_parameters": 1e9})
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and type(cfg.sdp_reduce_bucket_size) is int
    assert type(cfg.sdp_max_live_parameters) is int


@pytest.mark.parametrize("value,got", [(True, "bool"), ("4", "str"), (2.5, "float"), (None, "NoneType")])
def test_non_int_values_are_rejected(value, got):
    with pytest.raises(SMPConfigError, match=rf"tensor_parallel_degree = .*expected an integer, got {got}"):
        SMPConfig.from_dict({"tensor_parallel_degree": value})


@pytest.mark.parametrize("value", [1, "true", 0, None])
def test_bool_keys_take_only_booleans(value):
    with pytest.raises(SMPConfigError, match=r"ddp = .*expected a boolean"):
        SMPConfig.from_dict({"ddp": value})


def test_float_keys_take_ints():
    assert SMPConfig.from_dict({"memory_weight": 1}).memory_weight == 1.0
    with pytest.raises(SMPConfigError, match=r"memory_weight = True: expected a number"):
        SMPConfig.from_dict({"memory_weight": True})


@pytest.mark.parametrize("raw,match", [
    ({"memory_weight": 1.5}, r"memory_weight = 1.5: must be <= 1"),
    ({"memory_weight": -0.1}, r"memory_weight = -0.1: must be >= 0"),
    ({"microbatches": 0}, r"microbatches = 0: must be >= 1"),
    ({"pipeline": "gpipe"}, r"pipeline = 'gpipe': must be one of interleaved, simple, _only_forward"),
    ({"placement_strategy": "DDT"}, r"placement_strategy = 'DDT': must be 'cluster', 'spread' or a permutation"),
    ({"tensor_paralel_degree": 2}, r"tensor_paralel_degree = 2: unknown smp option.*did you mean 'tensor_parallel_degree'"),
])
def test_value_rules(raw, match):
    with pytest.raises(SMPConfigError, match=match):
        SMPConfig.from_dict(raw)


@pytest.mark.parametrize("strategy,order", [("cluster", "DPT"), ("spread", "TPD"), ("DTP", "DTP"), ("ptd", "PTD")])
def test_placement_letter_forms_are_accepted(strategy, order):
    # spec §5.3: the SDK rejects the letter forms that [DOC] documents; we accept them.
    assert SMPConfig.from_dict({"placement_strategy": strategy}).placement_order == order


def test_all_problems_are_reported_at_once():
    with pytest.raises(SMPConfigError) as info:
        SMPConfig.from_dict({"ddp": "yes", "microbatches": 0, "bogus": 1})
    assert sorted(info.value.keys) == ["bogus", "ddp", "microbatches"]
    assert "3 problems" in str(info.value)


# -- launch-time parameters win ----------------------------------------------------------------
def test_sm_hp_mp_parameters_override_the_script_dict():
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"microbatches": 4, "ddp": True})}
    cfg = SMPConfig.from_sources({"microbatches": 2, "pipeline_parallel_degree": 2}, environ=env)
    assert (cfg.microbatches, cfg.pipeline_parallel_degree, cfg.ddp) == (4, 2, True)
    assert SMPConfig.from_sources({"microbatches": 2}, environ={"SM_HP_MP_PARAMETERS": "{}"}).microbatches == 2


@pytest.mark.parametrize("text,match", [("{not json", "SM_HP_MP_PARAMETERS.*not valid JSON"),
                                        ("[1, 2]", "SM_HP_MP_PARAMETERS.*must hold a JSON object")])
def test_bad_sm_hp_mp_parameters(text, match):
    with pytest.raises(SMPConfigError, match=match):
        SMPConfig.from_sources({}, environ={"SM_HP_MP_PARAMETERS": text})


# -- spec §5 inconsistencies ---------------------------------------------------------------------
def test_5_1_pipeline_parallel_degree_omitted_is_one():
    assert SMPConfig.from_dict({"ddp": True}).pipeline_parallel_degree == 1


def test_5_2_default_partition_with_only_pipeline_parallel_degree():
    cfg = SMPConfig.from_dict({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 1})
    assert (cfg.auto_partition, cfg.default_partition) == (False, 1)


def test_5_2_default_partition_out_of_range():
    with pytest.raises(SMPConfigError, match=r"default_partition = 2: must be < pipeline_parallel_degree \(2\)"):
        SMPConfig.from_dict({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 2})


def test_1_2_auto_partition_false_requires_default_partition():
    with pytest.raises(SMPConfigError, match=r"default_partition = None: is required when auto_partition is false "
                                             r"\(SageMaker SDK rule\).*add default_partition: 0"):
        SMPConfig.from_dict({"pipeline_parallel_degree": 2, "auto_partition": False})


def test_5_10_sdp_equal_to_dp_is_accepted():
    dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": 8}), 8)
    assert (dims.zero_stage, dims.hpz_partition_size) == (3, 1)


@pytest.mark.parametrize("raw,expected", [
    ({}, 1),  # default partitions + 2 = 3 > microbatches 1
    ({"pipeline_parallel_degree": 2, "microbatches": 8}, 4),  # default 2 + 2 fits
    ({"microbatches": 4, "active_microbatches": 10}, 4),  # a user value is clamped the same way
    ({"microbatches": 4, "active_microbatches": 2}, 2),
])
def test_5_5_active_microbatches_clamped(raw, expected):
    assert SMPConfig.from_dict(raw).active_microbatches == expected


def test_5_13_bf16_without_sdp_is_accepted():
    cfg = SMPConfig.from_dict({"bf16": True})
    assert cfg.bf16 and not cfg.sharded_data_parallel


def test_5_14_partial_checkpoint_names():
    pytest.skip("partial checkpoint file names are a runtime behaviour (tests/distributed)")


# -- cross-key rules -----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,match", [
    ({"tensor_parallel_degree": 2}, r"tensor_parallel_degree = 2: > 1 requires ddp: true"),
    ({"sharded_data_parallel_degree": 2}, r"sharded_data_parallel_degree = 2: > 1 requires ddp: true"),
    ({"shard_optimizer_state": True}, r"shard_optimizer_state = True: requires ddp: true"),
    ({"fp16": True, "bf16": True}, r"bf16 = True: cannot be combined with fp16"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2},
     r"sharded_data_parallel_degree = 2: cannot be combined with pipeline_parallel_degree"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
     r"shard_optimizer_state = True: cannot be combined with sharded_data_parallel_degree"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2},
     r"prescaled_batch = False: must be true when sharded data parallel is combined with tensor parallelism"),
    ({"ddp_port": 1234}, r"ddp_port = 1234: is only allowed together with the ddp key"),
    ({"ddp": True, "horovod": True}, r"horovod"),
])
def test_cross_key_rules(raw, match):
    with pytest.raises(SMPConfigError, match=match):
        SMPConfig.from_dict(raw)


def test_sdp_with_tp_and_prescaled_batch_is_accepted():
    cfg = SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2,
                               "prescaled_batch": True})
    assert ParallelDims.from_config(cfg, 8, "hpz").hpz_partition_size == 2
    mics = ParallelDims.from_config(cfg, 8)  # the default engine for sdp < rdp: smp v1's MiCS
    assert (mics.engine, mics.mics_group_size, mics.hpz_partition_size) == ("mics", 2, 1)


# -- distribution dicts --------------------------------------------------------------------------
def _dist(params, **mpi):
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, **mpi}}


def test_distribution_dict_is_parsed():
    job = job_from_mapping({**_dist({"ddp": True}, processes_per_host=4, custom_mpi_options="-x A=1"), "instance_count": 2})
    assert (job.options, job.processes_per_host, job.instance_count, job.custom_mpi_options, job.source) == \
        ({"ddp": True}, 4, 2, "-x A=1", "distribution")


def test_instance_groups_of_a_heterogeneous_cluster_are_accepted_and_explained(tmp_path, capsys):
    """The DLC heterogeneous-cluster MNIST test puts instance_groups in its distribution dict: the
    job runs on the hosts it is launched on, which --explain says."""
    from smp_adapter.cli import main

    data = {**_dist({"ddp": True, "partitions": 2}, processes_per_host=2), "instance_groups": ["train_group"]}
    job = job_from_mapping(data)
    assert job.extra == {"instance_groups": ["train_group"]} and job.options == {"ddp": True, "partitions": 2}
    (tmp_path / "job.json").write_text(json.dumps(data))
    assert main(["translate", str(tmp_path / "job.json"), "--explain"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("instance_groups"))
    assert "ignored" in line and "the job runs on the hosts it is launched on" in line


def test_parameters_may_be_a_path_to_a_json_file(tmp_path):
    (tmp_path / "smp.json").write_text(json.dumps({"ddp": True, "microbatches": 2}))
    (tmp_path / "job.yaml").write_text("smdistributed:\n  modelparallel:\n    enabled: true\n    parameters: smp.json\n"
                                       "mpi:\n  enabled: true\n  processes_per_host: 2\n")
    job = load_job(str(tmp_path / "job.yaml"))  # relative to the file that names it
    assert job.options == {"ddp": True, "microbatches": 2} and job.config().microbatches == 2


@pytest.mark.parametrize("data,match", [
    ({"smdistributed": {"dataparallel": {"enabled": True}}, "mpi": {"enabled": True}},
     r"smdistributed.*exactly the key 'modelparallel'.*SageMaker's data-parallel library"),
    ({"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {"enabled": True}}},
     r"torch_distributed: selects SageMaker model parallelism v2"),
    ({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {}}}}, r"mpi = None: is required for smp v1"),
    (_dist({}) | {"mpi": {"enabled": False}}, r"mpi.enabled = False: must be true"),
    (_dist({}, processes_per_host=0), r"mpi.processes_per_host = 0: must be an integer >= 1"),
    (_dist({}, hosts=2), r"mpi.hosts: is not an mpi option"),
    (_dist({}) | {"instance_groups": "train"}, r"instance_groups = 'train': must be a list of instance group names"),
    ({"smdistributed": {"modelparallel": {"enabled": False}}, "mpi": {"enabled": True}},
     r"smdistributed.modelparallel.enabled = False: is not true"),
])
def test_bad_distribution_dicts(data, match):
    with pytest.raises(SMPConfigError, match=match):
        job_from_mapping(data)


def test_smp_options_section_and_distribution_section(tmp_path):
    (tmp_path / "a.yaml").write_text("smp_options:\n  ddp: true\n  microbatches: 2\n")
    assert load_job(str(tmp_path / "a.yaml")).options == {"ddp": True, "microbatches": 2}
    (tmp_path / "b.json").write_text(json.dumps({"distribution": _dist({"ddp": True}, processes_per_host=2),
                                                 "instance_count": 3}))
    job = load_job(str(tmp_path / "b.json"))
    assert (job.instance_count, job.processes_per_host) == (3, 2)


# -- ParallelDims --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,world,match", [
    ({"ddp": True, "tensor_parallel_degree": 3}, 8, r"tensor_parallel_degree = 3: .*= 3 does not divide the number of processes \(8\)"),
    ({"ddp": True, "pipeline_parallel_degree": 3}, 4, r"pipeline_parallel_degree = 3: .*does not divide"),
    ({"ddp": True, "sharded_data_parallel_degree": 3}, 8, r"sharded_data_parallel_degree = 3: must divide the number of model replicas"),
    ({"pipeline_parallel_degree": 2}, 4, r"ddp = False: must be true when there is more than one model replica \(2 replicas"),
    ({"ddp": True}, 0, r"world_size = 0: must be a positive integer"),
])
def test_parallel_dims_errors(raw, world, match):
    with pytest.raises(SMPConfigError, match=match):
        ParallelDims.from_config(SMPConfig.from_dict(raw), world)


@pytest.mark.parametrize("raw,world,stage,hpz", [
    ({}, 1, 0, 1),
    ({"ddp": True}, 8, 0, 1),
    ({"ddp": True, "shard_optimizer_state": True}, 8, 1, 1),
    ({"ddp": True, "shard_optimizer_state": True, "tensor_parallel_degree": 2}, 8, 1, 1),
    ({"ddp": True, "sharded_data_parallel_degree": 8}, 8, 3, 1),
    ({"ddp": True, "sharded_data_parallel_degree": 4}, 8, 3, 4),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, 32, 3, 2),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "prescaled_batch": True}, 4, 3, 1),
])
def test_zero_stage_and_hpz_selection(raw, world, stage, hpz):
    dims = ParallelDims.from_config(SMPConfig.from_dict(raw), world, "hpz")  # SMP_ADAPTER_SDP_ENGINE=hpz
    assert (dims.zero_stage, dims.hpz_partition_size) == (stage, hpz)
    mics = ParallelDims.from_config(SMPConfig.from_dict(raw), world)  # the default: MiCS where sdp < rdp
    assert (mics.zero_stage, mics.mics_group_size, mics.hpz_partition_size) == (stage, hpz, 1)
    assert mics.engine == ("mics" if hpz > 1 else "deepspeed")


def test_sdp_engine_setting_is_read_and_checked():
    from smp_adapter.config.dims import sdp_engine_from

    assert [sdp_engine_from(e) for e in ({}, {"SMP_ADAPTER_SDP_ENGINE": "HPZ"}, {"SMP_ADAPTER_SDP_ENGINE": "mics"})] == \
        ["mics", "hpz", "mics"]
    with pytest.raises(SMPConfigError, match="SMP_ADAPTER_SDP_ENGINE=mics"):
        sdp_engine_from({"SMP_ADAPTER_SDP_ENGINE": "zero3"})
    fp16 = SMPConfig.from_dict({"ddp": True, "sharded_data_parallel_degree": 2, "fp16": True})
    assert ParallelDims.from_config(fp16, 4).engine == "mics"  # fp16 runs on MiCS (its loss scaling) and on hpZ
    assert ParallelDims.from_config(fp16, 4, "hpz").hpz_partition_size == 2


def test_batch_arithmetic():
    dims = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "tensor_parallel_degree": 2, "microbatches": 4}), 8)
    assert (dims.rdp, dims.dp, dims.micro_batch_size(8), dims.global_batch_size(8)) == (4, 8, 2, 64)
    prescaled = ParallelDims.from_config(SMPConfig.from_dict({"ddp": True, "tensor_parallel_degree": 2,
                                                             "prescaled_batch": True}), 8)
    assert prescaled.global_batch_size(8) == 32
    # spec §3.6: without prescaling a TP layer works on the group's exchanged batch [tp·B, S, H/tp];
    # prescaled, the group's shared batch is only sliced [B, S, H/tp]
    assert (dims.tp_region_batch(2), prescaled.tp_region_batch(2)) == (4, 2)
    with pytest.raises(SMPConfigError, match=r"microbatches = 4: must divide the per-rank batch size \(6\)"):
        dims.micro_batch_size(6)


def test_yaml_files_read_float_notation_ints(tmp_path):
    from smp_adapter.config.distribution import load_job

    path = tmp_path / "opts.yaml"
    path.write_text("ddp: true\nsdp_reduce_bucket_size: 5e8\n")
    assert load_job(str(path)).config().sdp_reduce_bucket_size == 500_000_000
