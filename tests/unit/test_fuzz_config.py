"""Property tests over generated smp option dicts and SageMaker distribution dicts: every input
either translates to a DeepSpeed config that DeepSpeed's own parser accepts, or raises
SMPConfigError naming a key. No other exception type may escape (issue: reliability)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.distribution import job_from_mapping
from smp_adapter.config.keys import KEYS
from smp_adapter.config.options import SMPConfig
from smp_adapter.errors import SMPConfigError
from smp_adapter.translate.deepspeed import to_deepspeed_config
from smp_adapter.translate.launch import to_launch_plan
from smp_adapter.translate.megatron import to_megatron_plan

os.environ.setdefault("DS_ACCELERATOR", "cpu")
EXAMPLES = int(os.environ.get("SMP_FUZZ_EXAMPLES", "1400"))  # + half as many distribution dicts: 2,100 in CI

# Values of every type, near the edges: the right type in and out of range, and wrong types.
any_value = st.one_of(
    st.booleans(), st.integers(-3, 70), st.sampled_from([0, 1, 2, 4, 8, 5e8, 1e6, 2.5, -1.0, float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["cluster", "spread", "DPT", "TPD", "xyz", "",
                                                                     "simple", "interleaved", "memory", "speed", "auto",
                                                                     "nccl", "4"]),
    st.none(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
degree = st.sampled_from([1, 1, 1, 2, 2, 4, 3])
key_names = st.sampled_from(sorted(KEYS) + ["pipline", "tensor_parallel", "ddp_typo", "enabled"])
options = st.fixed_dictionaries(
    {}, optional={"ddp": st.booleans(), "pipeline_parallel_degree": degree, "tensor_parallel_degree": degree,
                  "sharded_data_parallel_degree": degree, "microbatches": degree, "shard_optimizer_state": st.booleans(),
                  "fp16": st.booleans(), "bf16": st.booleans(), "prescaled_batch": st.booleans(),
                  "placement_strategy": st.sampled_from(["cluster", "spread", "PTD", "TDP", "DTP"]),
                  "offload_activations": st.booleans(), "delayed_parameter_initialization": st.booleans()}
).flatmap(lambda base: st.dictionaries(key_names, any_value, max_size=3).map(lambda noise: {**base, **noise}))


class DataParallelMpu:
    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


def _translate_or_config_error(raw, world_size):
    try:
        cfg = SMPConfig.from_dict(raw)
        dims = ParallelDims.from_config(cfg, world_size)
        ds = to_deepspeed_config(dims, per_rank_batch=cfg.microbatches * 2)
        to_megatron_plan(dims, per_rank_batch=cfg.microbatches * 2)
    except SMPConfigError as err:
        assert err.problems and all(p.key for p in err.problems)
        assert all(p.key in str(err) for p in err.problems)
        return None
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(ds, mpu=DataParallelMpu(dims.rdp))
    assert parsed.zero_optimization_stage == dims.zero_stage
    assert parsed.gradient_accumulation_steps == cfg.microbatches
    return ds


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=options, world_size=st.sampled_from([1, 2, 4, 8, 6, 16]))
def test_generated_options_translate_or_name_a_key(raw, world_size):
    _translate_or_config_error(raw, world_size)


mpi = st.one_of(st.none(), st.just("yes"), st.fixed_dictionaries(
    {"enabled": st.sampled_from([True, True, False, "true"])},
    optional={"processes_per_host": st.sampled_from([1, 2, 4, 8, 0, "8", 2.0]),
              "custom_mpi_options": st.sampled_from(["", "--mca btl_vader_single_copy_mechanism none", 3]),
              "bogus": st.integers()}))
distribution = st.fixed_dictionaries(
    {"mpi": mpi},
    optional={"smdistributed": st.one_of(
        st.fixed_dictionaries({"modelparallel": st.fixed_dictionaries(
            {"enabled": st.sampled_from([True, True, False, None])}, optional={"parameters": options})}),
        st.just({"dataparallel": {"enabled": True}}), st.just({}), st.just("x")),
        "instance_count": st.sampled_from([1, 2, 0, "2", True]), "torch_distributed": st.just({"enabled": True})})


@settings(max_examples=max(EXAMPLES // 2, 100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dist=distribution)
def test_generated_distribution_dicts_translate_or_name_a_key(dist):
    try:
        job = job_from_mapping(dist)
        cfg = job.config()
        ppn = job.processes_per_host or 1
        plan = to_launch_plan(job, cfg, "train.py", nprocs_per_node=ppn, cpu=True)
    except SMPConfigError as err:
        assert err.problems and all(p.key in str(err) for p in err.problems)
        return
    assert plan.command and "SM_HP_MP_PARAMETERS" in plan.env
    _translate_or_config_error(job.options, ppn * job.instance_count)


def test_fuzz_runs_enough_examples_in_ci():
    assert EXAMPLES + max(EXAMPLES // 2, 100) >= 2000 or os.environ.get("SMP_FUZZ_EXAMPLES")
    pytest.importorskip("hypothesis")
