"""ZeRO-3's buffers at wrap time (translate/deepspeed.zero3_buffer_sizes, bounded_zero3_buffers): the
reduce and prefetch buckets the smp options leave at DeepSpeed's default are cut to the model's largest
parameter where the default is larger; max_live_parameters and the reuse distance keep DeepSpeed's
defaults (bounding them changes what is gathered); a given sdp_max_live_parameters sets both; given
values, other stages and large models keep theirs; plan predicts with the same sizes. Kernel-measured effect: benchmarks/kernel_memory.py
(RESULTS.md §18.2)."""

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.plan.costs import zero3_buffers
from smp_adapter.translate.deepspeed import bounded_zero3_buffers, to_deepspeed_config

BUCKETS = {"reduce_bucket_size", "stage3_prefetch_bucket_size"}


def _config(options, world=2):
    cfg = SMPConfig.from_dict(options)
    return cfg, to_deepspeed_config(ParallelDims.from_config(cfg, world))


def test_the_buckets_are_bounded_by_the_largest_parameter_and_the_gathering_keys_are_not():
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2})
    out, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=4_194_304)
    assert set(changed) == BUCKETS
    for key in BUCKETS:
        assert out["zero_optimization"][key] == 4_194_304
    assert out["zero_optimization"]["stage3_max_live_parameters"] == 10**9
    assert out["zero_optimization"].get("stage3_max_reuse_distance", 10**9) == 10**9
    assert "stage3_prefetch_bucket_size" not in ds["zero_optimization"]  # the input is not changed


def test_given_keys_and_large_models_keep_their_values():
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 1000,
                       "sdp_max_live_parameters": 5000})
    out, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=4_194_304)
    assert out["zero_optimization"]["reduce_bucket_size"] == 1000
    assert set(changed) == {"stage3_prefetch_bucket_size"}  # the translation wrote the reuse distance already
    # one choice of how much a rank keeps gathered: the given max live sets the reuse distance too
    assert out["zero_optimization"]["stage3_max_live_parameters"] == 5000
    assert out["zero_optimization"]["stage3_max_reuse_distance"] == 5000
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2})
    _, changed = bounded_zero3_buffers(ds, cfg, largest_parameter=10**9)  # a parameter of DeepSpeed's sizes
    assert changed == {}


def test_plan_predicts_with_the_sizes_the_runtime_gives_deepspeed():
    cfg, ds = _config({"ddp": True, "sharded_data_parallel_degree": 2})
    out, _ = bounded_zero3_buffers(ds, cfg, largest_parameter=4_194_304)
    predicted = zero3_buffers(cfg, [4_194_304, 2048, 1_000_000])
    for key, size in predicted.items():
        assert out["zero_optimization"].get(key, size) == size, key


def test_other_stages_are_untouched():
    cfg, ds = _config({"ddp": True, "shard_optimizer_state": True})
    assert bounded_zero3_buffers(ds, cfg, largest_parameter=10) == (ds, {})
