"""ZeRO-3's default buffers bounded by the model at wrap time (translate/deepspeed.bounded_zero3_buffers):
a buffer the smp options leave at DeepSpeed's default is cut to twice the model's largest parameter
where the default is larger; given values, other stages and large models keep theirs. Kernel-measured
effect: benchmarks/kernel_memory.py (RESULTS.md §18)."""

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.translate.deepspeed import ZERO3_BUFFERS, bounded_zero3_buffers, to_deepspeed_config


def _config(options, world=2):
    cfg = SMPConfig.from_dict(options)
    return cfg, to_deepspeed_config(ParallelDims.from_config(cfg, world))


def test_defaults_are_bounded_by_twice_the_largest_parameter():
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2})
    out, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=4_194_304)
    assert set(changed) == set(ZERO3_BUFFERS)
    for key in ZERO3_BUFFERS:
        assert out["zero_optimization"][key] == 8_388_608
    assert "stage3_prefetch_bucket_size" not in ds["zero_optimization"]  # the input is not changed


def test_given_keys_and_large_models_keep_their_values():
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 1000})
    out, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=4_194_304)
    assert out["zero_optimization"]["reduce_bucket_size"] == 1000 and "reduce_bucket_size" not in changed
    assert "stage3_max_live_parameters" in changed  # the one not given is still bounded
    _, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=10**9)  # a 20B model's embedding
    assert changed == {}


def test_other_stages_are_untouched():
    cfg, ds = _config({"ddp": True, "shard_optimizer_state": True})
    assert bounded_zero3_buffers(ds, cfg, largest_parameter=10) == (ds, {})
