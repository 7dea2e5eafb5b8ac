"""The three front doors (``smp-adapter translate``, ``smp-adapter launch``'s plan, ``smp.init``)
accept and refuse the same option sets on the same world size: each builds the same ParallelDims,
where every layout rule lives. Checked on generated option sets, hpZ with tensor parallelism
(sdp < rdp with tp > 1, smp v1.15's layout) included."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smp_adapter.commands.translate import translation_bundle
from smp_adapter.config.distribution import JobSpec
from smp_adapter.errors import SMPConfigError
from smp_adapter.runtime.init import resolve_layout
from smp_adapter.launch.command import to_launch_plan

degree = st.sampled_from([1, 1, 2, 2, 4, 3])
options = st.fixed_dictionaries(
    {}, optional={"ddp": st.booleans(), "pipeline_parallel_degree": degree, "tensor_parallel_degree": degree,
                  "sharded_data_parallel_degree": degree, "microbatches": degree, "shard_optimizer_state": st.booleans(),
                  "prescaled_batch": st.booleans(), "bf16": st.booleans(), "fp16": st.booleans(),
                  "placement_strategy": st.sampled_from(["cluster", "spread", "PTD"])})


def _outcome(call):
    try:
        call()
    except SMPConfigError as err:
        return sorted(err.keys)
    return "accepted"


def _outcomes(raw: dict, world_size: int) -> dict:
    job = JobSpec(options=raw)
    return {
        "smp.init": _outcome(lambda: resolve_layout(raw, {"RANK": "0", "WORLD_SIZE": str(world_size)})),
        "translate": _outcome(lambda: translation_bundle(job, world_size=world_size)),
        "launch": _outcome(lambda: to_launch_plan(job, None, "train.py", nprocs_per_node=world_size, cpu=True)),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=options, world_size=st.sampled_from([1, 2, 4, 8, 6, 16]))
def test_translate_launch_and_init_agree_on_generated_options(raw, world_size):
    got = _outcomes(raw, world_size)
    assert got["translate"] == got["smp.init"] == got["launch"], got


@pytest.mark.parametrize("world_size,raw", [
    (8, {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True}),
    (32, {"ddp": True, "tensor_parallel_degree": 4, "sharded_data_parallel_degree": 4, "prescaled_batch": True}),
])
def test_hpz_with_tensor_parallelism_is_accepted_by_every_front_door(world_size, raw):
    assert _outcomes(raw, world_size) == {"smp.init": "accepted", "translate": "accepted", "launch": "accepted"}
    _, dims, _ = resolve_layout(raw, {"RANK": "0", "WORLD_SIZE": str(world_size), "SMP_ADAPTER_SDP_ENGINE": "hpz"})
    assert dims.hpz_partition_size == raw["sharded_data_parallel_degree"] < dims.rdp
    _, dims, _ = resolve_layout(raw, {"RANK": "0", "WORLD_SIZE": str(world_size)})  # the default: MiCS
    assert dims.mics_group_size == raw["sharded_data_parallel_degree"] and dims.engine == "mics"
