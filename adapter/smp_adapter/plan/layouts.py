"""Which layouts a cluster can run (``plan --search``): every (pp, tp, sdp, ZeRO-1, microbatches)
the config layer accepts (ParallelDims decides; nothing is re-implemented here), plus the model's
own limit that tensor parallelism splits attention heads."""

from __future__ import annotations

from smp_adapter.config.dims import ParallelDims
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem
from smp_adapter.errors import SMPConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_options(base: dict, world: int, batch: int) -> list[dict]:
    out = []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            rdp = world // (pp * tp)
            micro = [base.get("microbatches", 1)] if pp == 1 else [m for m in divisors(batch) if m >= pp] or [batch]
            for sdp in divisors(rdp):
                for shard in ((False, True) if sdp == 1 and rdp > 1 else (False,)):
                    for m in micro:
                        out.append({**base, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                                    "sharded_data_parallel_degree": sdp, "shard_optimizer_state": shard,
                                    "microbatches": m, "ddp": True})
    return out


def model_problems(spec, tp: int) -> list[ConfigProblem]:
    """The model's own limit on a layout: tensor parallelism splits the attention heads."""
    if spec.heads % tp:
        return [ConfigProblem("tensor_parallel_degree", f"must divide the model's {spec.heads} attention heads",
                              "choose a tensor_parallel_degree that divides the head count", tp)]
    return []


def valid_layouts(base: dict, world: int, batch: int, spec) -> list[ParallelDims]:
    layouts = []
    for options in candidate_options(base, world, batch):
        if model_problems(spec, options["tensor_parallel_degree"]):
            continue
        try:
            dims = ParallelDims.from_config(SMPConfig.from_dict(options), world)
            dims.micro_batch_size(batch)
        except SMPConfigError:
            continue
        layouts.append(dims)
    return layouts
