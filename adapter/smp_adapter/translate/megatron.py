"""smp options -> Megatron-core parallel settings (pure; no megatron or torch import).

What Megatron gets:
  tensor_parallel_degree     -> tensor_model_parallel_size
  pipeline_parallel_degree   -> pipeline_model_parallel_size (no virtual stages: smp has none)
  placement_strategy         -> ``order`` for parallel_state.initialize_model_parallel
  rdp size                   -> data_parallel_size (Megatron's "dp" is smp's *reduced* DP)
  shard_optimizer_state/sdp  -> use_distributed_optimizer (optimizer state sharded over DP)
  fp16 / bf16                -> fp16 / bf16

Batch arithmetic. smp scripts pass a per-rank batch B to ``smp.step``; Megatron counts samples
per *model replica* (a TP x PP group), so without ``prescaled_batch`` a TP group of tp ranks,
each reading its own B samples, is one replica processing tp x B samples (docs/translation.md §3, derived settings):

  global_batch_size = dims.global_batch_size(B)     (dp x B, or rdp x B with prescaled_batch)
  micro_batch_size  = global_batch_size / (rdp x microbatches)   (samples per replica per microbatch)
  num_microbatches  = microbatches

Placement and Megatron-LM's command line. Megatron-core's RankGenerator puts the *first* token
of ``order`` at stride 1; Megatron-LM's CLI only offers two orders: the default
"tp-cp-ep-dp-pp" and, with ``--use-tp-pp-dp-mapping``, "tp-cp-ep-pp-dp" (checked in
megatron/training/initialize.py of Megatron-LM; the megatron-core 0.16.1 wheel ships no
megatron/training, its parallel_state docstring says "we support tp-dp-pp and tp-pp-dp orders").
cp and ep are 1 for smp v1, so with all three degrees > 1:
  cluster (DPT) -> "tp-pp-dp" = --use-tp-pp-dp-mapping      (exact)
  PDT           -> "tp-dp-pp" = Megatron-LM's default        (exact)
  DTP, PTD, TDP, spread (TPD): TP is not the fastest axis -> no Megatron-LM CLI equivalent;
  pass ``order`` to initialize_model_parallel directly. (smp-adapter's own runtime never calls
  initialize_model_parallel: its tensor-parallel layers take smp's TP group directly, parallel/layers.py.)
Axes of size 1 do not affect placement, so they are dropped before comparing; e.g. spread
with tp = 1 is the CLI default, and any strategy with pp = 1 and tp = 1 is exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from smp_adapter.config.dims import ParallelDims

MEGATRON_LM_DEFAULT_ORDER = "tp-dp-pp"  # "tp-cp-ep-dp-pp" with cp = ep = 1
MEGATRON_LM_TP_PP_DP_ORDER = "tp-pp-dp"  # what --use-tp-pp-dp-mapping selects
TP_PP_DP_FLAG = "--use-tp-pp-dp-mapping"
SEQUENCE_PARALLEL = False  # smp v1 has no sequence parallelism


def tp_layer_settings(tp: int) -> dict[str, Any]:
    """The Megatron-core settings smp's tensor-parallel layers are built with (parallel/layers.py
    passes them to ModelParallelConfig and to Megatron's linear functions), the same a plan prints:
    the TP degree, no sequence parallelism, no fused gradient accumulation (a CUDA kernel)."""
    return {"tensor_model_parallel_size": tp, "sequence_parallel": SEQUENCE_PARALLEL,
            "gradient_accumulation_fusion": False}


@dataclass(frozen=True)
class MegatronPlan:
    """Arguments for ``megatron.core.parallel_state.initialize_model_parallel`` and the batch shape."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    order: str  # RankGrid.megatron_order(): first token varies fastest over global ranks
    data_parallel_size: int  # smp rdp size
    world_size: int
    micro_batch_size: int  # samples per model replica per microbatch
    global_batch_size: int  # samples per optimizer step over the whole job
    num_microbatches: int
    use_distributed_optimizer: bool = False
    fp16: bool = False
    bf16: bool = False
    virtual_pipeline_model_parallel_size: int | None = None  # smp has no interleaved virtual stages
    sequence_parallel: bool = SEQUENCE_PARALLEL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- Megatron-LM equivalent -----------------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tensor_model_parallel_size, "pp": self.pipeline_model_parallel_size,
                "dp": self.data_parallel_size}

    def _effective(self, order: str) -> list[str]:
        """The order with size-1 axes removed: only axes of size > 1 decide rank placement."""
        sizes = self._sizes()
        return [t for t in order.split("-") if sizes.get(t, 1) > 1]

    def megatron_lm_order_flag(self) -> str | None:
        """'' when Megatron-LM's default order is this layout, the flag when the flag gives it,
        None when its CLI cannot express it."""
        mine = self._effective(self.order)
        if mine == self._effective(MEGATRON_LM_DEFAULT_ORDER):
            return ""
        if mine == self._effective(MEGATRON_LM_TP_PP_DP_ORDER):
            return TP_PP_DP_FLAG
        return None

    def megatron_lm_note(self) -> str | None:
        """Why the Megatron-LM arguments do not reproduce the placement, or None when they do."""
        if self.megatron_lm_order_flag() is not None:
            return None
        return (f"rank order {self.order!r} (first axis fastest) has no Megatron-LM command-line equivalent: "
                f"its CLI offers only {MEGATRON_LM_DEFAULT_ORDER} (default) and {MEGATRON_LM_TP_PP_DP_ORDER} "
                f"({TP_PP_DP_FLAG}); pass order={self.order!r} to "
                "megatron.core.parallel_state.initialize_model_parallel (smp-adapter's runtime does)")

    def to_megatron_lm_args(self) -> list[str]:
        """The equivalent Megatron-LM (pretrain_*.py) arguments. See megatron_lm_note() for
        placements they cannot express; the args then use Megatron-LM's default order."""
        args = ["--tensor-model-parallel-size", str(self.tensor_model_parallel_size),
                "--pipeline-model-parallel-size", str(self.pipeline_model_parallel_size),
                "--micro-batch-size", str(self.micro_batch_size),
                "--global-batch-size", str(self.global_batch_size)]
        if self.fp16:
            args.append("--fp16")
        if self.bf16:
            args.append("--bf16")
        if self.use_distributed_optimizer:
            args.append("--use-distributed-optimizer")
        if self.megatron_lm_order_flag():
            args.append(TP_PP_DP_FLAG)
        return args


def to_megatron_plan(dims: ParallelDims, per_rank_batch: int | None = None) -> MegatronPlan:
    """Megatron settings for ``dims``. ``per_rank_batch`` is the batch each rank passes to
    smp.step (default: one sample per microbatch, as in to_deepspeed_config)."""
    cfg = dims.cfg
    per_rank_batch = cfg.microbatches if per_rank_batch is None else per_rank_batch
    dims.micro_batch_size(per_rank_batch)  # raises SMPConfigError if microbatches does not divide it
    global_batch = dims.global_batch_size(per_rank_batch)
    # Exact: global = rdp x B x (tp or 1) and microbatches divides B.
    micro = global_batch // (dims.rdp * cfg.microbatches)
    return MegatronPlan(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        order=dims.grid.megatron_order(),
        data_parallel_size=dims.rdp,
        world_size=dims.world_size,
        micro_batch_size=micro,
        global_batch_size=global_batch,
        num_microbatches=cfg.microbatches,
        use_distributed_optimizer=bool(cfg.shard_optimizer_state or dims.sdp > 1),
        fp16=cfg.fp16,
        bf16=cfg.bf16,
    )
