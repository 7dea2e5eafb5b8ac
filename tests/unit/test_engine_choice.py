"""The engine is chosen once, from the layout (ParallelDims.engine), and everything reads that choice:
smp.init, the translate bundle and --explain. The DeepSpeed config is built once per job and the
optimizer's arguments are applied to it (translate/deepspeed.with_engine_arguments)."""

from __future__ import annotations

import pytest

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.distribution import JobSpec
from smp_adapter.config.options import SMPConfig
from smp_adapter.translate.deepspeed import LossScaleArgs, to_deepspeed_config, with_engine_arguments


def dims_of(raw, world):
    return ParallelDims.from_config(SMPConfig.from_dict(raw), world)


LAYOUTS = [
    ({"ddp": True}, 2),
    ({"ddp": True, "shard_optimizer_state": True, "fp16": True, "microbatches": 2}, 2),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "bf16": True}, 4),
    ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 4, "fp16": True}, 4),
]


@pytest.mark.parametrize("raw,world", LAYOUTS)
@pytest.mark.parametrize("backend", [None, "gloo", "nccl"])
def test_engine_arguments_on_the_job_config_equal_the_full_build(raw, world, backend):
    """The reference is to_deepspeed_config given every argument at once (what the engine was built
    from before the job's config was built once)."""
    dims = dims_of(raw, world)
    job_config = to_deepspeed_config(dims, backend=backend)
    before = repr(job_config)
    for loss_scale, passes in [(None, 1), (LossScaleArgs(static_loss_scale=128.0), 2),
                               (LossScaleArgs(dynamic_loss_scale=True, init_scale=2**16, scale_window=50), 3)]:
        expected = to_deepspeed_config(dims, loss_scale=loss_scale, backward_passes_per_step=passes, backend=backend)
        assert with_engine_arguments(job_config, dims, loss_scale, passes) == expected
    assert repr(job_config) == before  # the job's config is never changed in place


def test_the_layout_names_the_engine_and_the_registry_follows_it():
    from smp_adapter.runtime.engines import engine_class

    assert dims_of({"pipeline_parallel_degree": 2}, 2).engine == "pipeline"
    assert dims_of({"ddp": True, "sharded_data_parallel_degree": 2}, 2).engine == "deepspeed"
    assert engine_class(dims_of({"pipeline_parallel_degree": 2}, 2).engine).name == "pipeline"


def test_explain_names_the_pipeline_engine_when_pp_is_above_one():
    from smp_adapter.commands.translate import translation_bundle

    rows = {r["key"]: r for r in translation_bundle(JobSpec(options={"pipeline_parallel_degree": 2, "microbatches": 2,
                                                                    "ddp": True}), world_size=4)["explain"]}
    row = rows["pipeline_parallel_degree"]
    assert row["engine_key"].startswith("pipeline engine: torch.distributed.pipelining")
    assert "not by DeepSpeed's PipelineEngine" in row["note"]
    rows = {r["key"]: r for r in translation_bundle(JobSpec(options={"pipeline_parallel_degree": 1, "ddp": True}),
                                                    world_size=2)["explain"]}
    assert "pipeline engine" not in rows["pipeline_parallel_degree"]["engine_key"]


def test_a_translate_bundle_places_the_layout_once(monkeypatch):
    from smp_adapter.commands.translate import translation_bundle

    calls = []
    original = ParallelDims.from_config.__func__

    def counting(cls, cfg, world_size, *rest):
        calls.append(world_size)
        return original(cls, cfg, world_size, *rest)

    monkeypatch.setattr(ParallelDims, "from_config", classmethod(counting))
    translation_bundle(JobSpec(options={"tensor_parallel_degree": 2, "ddp": True}), world_size=4)
    assert calls == [4]
