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
from smp_adapter.launch.command import to_launch_plan
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


# -- hostile input: huge integers, deep nesting, alias bombs, each under a time and memory budget --
def _within_budget(call):
    """Runs ``call``; it must end in an SMPConfigError naming a key or succeed, within 1 s and
    100 MB of new Python allocations (tracemalloc peak)."""
    import time
    import tracemalloc

    tracemalloc.start()
    # CPU seconds of this process, not wall-clock: the suite's workers share two cores with whatever
    # else runs, and the budget guards against work that grows with the input (CPU time measures it)
    start = time.process_time()
    try:
        call()
    except SMPConfigError as err:
        assert err.problems and all(p.key in str(err) for p in err.problems)
        assert len(str(err)) < 4000
    finally:
        elapsed = time.process_time() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MB"


huge_int = st.one_of(st.integers(-10**12, 10**12), st.sampled_from([2**31, 2**63, 10**18, 65536, 65537, True]))
nested = st.recursive(st.one_of(st.integers(), st.text(max_size=3), st.booleans()),
                      lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=2), inner, max_size=3)),
                      max_leaves=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree",
                            "microbatches", "active_microbatches", "default_partition", "sdp_reduce_bucket_size"]),
       value=huge_int, world_size=st.one_of(st.integers(1, 64), st.sampled_from([65536, 65537, 10**9])))
def test_huge_integers_end_quickly(key, value, world_size):
    _within_budget(lambda: _translate_or_config_error({"ddp": True, key: value}, world_size))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=nested, depth=st.integers(1, 3000), bracket=st.sampled_from(["[", '{"a":']))
def test_nested_values_and_deep_documents_end_quickly(value, depth, bracket):
    from smp_adapter.config.distribution import parse_inline_or_file

    _within_budget(lambda: SMPConfig.from_dict({"ddp": True, "pipline": value, "microbatches": value}))
    _within_budget(lambda: parse_inline_or_file(bracket * depth))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(2, 12), levels=st.integers(1, 9))
def test_yaml_alias_bombs_end_quickly(tmp_path_factory, width, levels):
    from smp_adapter.config.distribution import load_job

    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    path = tmp_path_factory.mktemp("bomb") / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    _within_budget(lambda: load_job(str(path)))
