"""The pipeline engine (pipeline_parallel_degree > 1): torch.distributed.pipelining stages.

There is no DeepSpeed engine here. The pieces, all in this folder:
  * ``PipelineRunner`` (runtime.py): cuts the model into stages at the first step, runs the
    schedule, reduces gradients (tied parameters over their stages, then TP / RDP);
  * ``PipelineMixedPrecision`` (mixed_precision.py): fp16/bf16 fp32 masters and loss scaling;
  * ``PipelineStateSharding`` (sharded_optimizer.py): shard_optimizer_state, ZeRO-1 over the
    stage's RDP group;
  * checkpoint.py: one file per (pp, tp) position, and the layout-independent pieces (saved for
    any other layout; a resume from another layout puts the optimizer state back at the first step).

An optimizer step: (fp16/bf16: overflow check, unscaled fp32 master gradients) -> clipping -> the
torch optimizer (sharded with shard_optimizer_state) -> (masters back into the model).
"""

from __future__ import annotations

from pathlib import Path

from smp_adapter.compat.torch_warnings import torch_pipelining_quiet
from smp_adapter.runtime.engines.base import Engine, model_dtype, refuse_full_sharded_optimizer_state
from smp_adapter.runtime.engines.deepspeed.process_group import StartsThroughDeepSpeed


class ClippingRecord:
    """The pipeline engine's answer to scripts that read DeepSpeed's ZeRO-optimizer attributes
    through smp's optimizer (DistributedOptimizer.__getattr__): ``_global_grad_norm``, the norm
    over all stages before the last step's clipping (the templates' "Grad norm" log line). As in
    DeepSpeed's ZeRO-3: 0.0 before the first clipped step, inf after a step skipped for an fp16
    overflow. Other names fall through to the torch optimizer."""

    _global_grad_norm = 0.0


class PipelineEngine(StartsThroughDeepSpeed, Engine):
    name = "pipeline"

    # The process group starts through DeepSpeed's communication layer as at pp = 1 (this engine
    # reuses DeepSpeed's loss scalers and partition solver, deepspeed/parts.py), so a job starts the
    # same whatever its pipeline degree. Sharded data parallel is refused with pp > 1, so no
    # parameter is ever a ZeRO-3 shard here: the other hooks keep Engine's defaults.
    @classmethod
    def refuse_unsupported(cls, cfg) -> None:
        from smp_adapter.runtime.engines.pipeline import torch_compat

        torch_compat.check_schedule(cfg.pipeline)

    @classmethod
    def load_code(cls, dims) -> None:
        """torch's pipelining, torch.export and the fake tensors the stages are traced with: ~75 MB
        of modules at import and ~28 MB (about 400 modules: export's passes, networkx) that the first
        trace imports, measured on torch 2.13. A two-layer model traced here loads them before any
        model exists (about a second), so that a rank's memory after smp.init holds the code it
        will run and what it gains later is the model's."""
        import torch
        from torch.distributed.pipelining import SplitPoint, pipeline
        tiny = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        with torch_pipelining_quiet():
            pipeline(tiny, (torch.zeros(1, 2),), {}, split_spec={"1": SplitPoint.BEGINNING})

    def place_module(self, module, device) -> None:
        """The model stays where the script made it (the host; without storage under delayed
        initialisation) until the first step cuts it: then each rank moves only its stage(s) to its
        device and drops the rest (stage_memory.py)."""

    def materialize_kept(self, module, device) -> None:
        """Nothing yet: which tensors this rank keeps is known when the first step cuts the stages."""

    def attach_model(self, model, tp_originals: dict) -> None:
        super().attach_model(model, tp_originals)
        from smp_adapter.runtime.engines.pipeline.runtime import PipelineRunner

        dtype = model_dtype(self.job.cfg)
        if dtype is not None:  # fp16/bf16: no DeepSpeed engine to cast the model
            model.module.to(dtype)
        # stages are cut at the first step call
        self.runner = PipelineRunner(model, self.job, self.progress, tp_originals)
        from smp_adapter.runtime.clipping import route_torch_clipping

        route_torch_clipping(self)  # torch's clip_grad_norm_ on the model: the norm over every stage
        self._mixed = None
        self._sharding = None
        self._resume_optimizer_state = None  # a resume from another layout: finished at the first step
        self._internals = ClippingRecord()
        self._timing = None  # (wall, busy) seconds of the last training step's schedule on this rank

    @property
    def optimizer_internals(self):
        return self._internals

    # -- model -----------------------------------------------------------------------------------
    def run_step(self, func, bound_mbs: list, detach: bool) -> list:
        import torch

        training = torch.is_grad_enabled() and self.model.training  # as the runner decides
        results = self.runner.run_step(func, bound_mbs, detach)
        self._timing = self.runner.clock.finish_step(training)
        return results

    def step_timing(self) -> dict | None:
        """The last step's schedule time on this rank, its compute part and the schedule's bubble
        formula (idle_time.py); None after an evaluation step."""
        if self._timing is None:
            return None
        from smp_adapter.config.pipeline_schedule import bubble_formula

        wall, busy = self._timing
        cfg = self.job.cfg
        return {"wall_s": wall, "busy_s": busy, "schedule": cfg.pipeline,
                "bubble": bubble_formula(cfg.pipeline, self.job.dims.pp, self.runner.layout.v)}

    def forward(self, args, kwargs):
        return self.runner.forward(args, kwargs)

    def backward(self, loss) -> None:
        self.runner.backward(loss)

    def local_named_parameters(self):
        return iter(self.runner.local_named_parameters())

    def local_named_buffers(self):
        return iter(self.runner.local_named_buffers())

    def local_named_modules(self):
        return iter(self.runner.local_named_modules())

    def merge_full_state_dict(self, sd: dict) -> dict:
        return self.runner.full_state_dict(sd)  # each stage contributes its entries

    def local_tensors(self) -> dict:
        """Copies of this rank's tensors (another stage's are meta here: none of its values are held)."""
        return {k: v.detach().clone().cpu() for k, v in self.model.module.state_dict().items() if not v.is_meta}

    def local_state_dict(self, sd: dict) -> dict:
        from smp_adapter.runtime.engines.pipeline.checkpoint import mark_stage

        return mark_stage(self.runner, self.runner.local_state_dict(sd))

    def load_local_state_dict(self, sd: dict, strict: bool):
        from smp_adapter.runtime.engines.pipeline.checkpoint import load_stage_state_dict

        return load_stage_state_dict(self.runner, sd, strict=strict)  # this stage's entries only

    # -- optimizer -------------------------------------------------------------------------------
    def attach_optimizer(self, optimizer, loss_scale) -> None:
        cfg = self.job.cfg
        if cfg.fp16 or cfg.bf16:
            from smp_adapter.runtime.engines.pipeline.mixed_precision import PipelineMixedPrecision

            self._mixed = PipelineMixedPrecision(model_dtype(cfg), loss_scale)
            self.runner.loss_scale_source = lambda: self._mixed.loss_scale

    @property
    def ready_for_checkpoint(self) -> bool:
        return True

    @property
    def mixed_precision(self):
        return self._mixed

    def optimizer_step(self, optimizer, clip_norm) -> None:
        mixed = self._mixed
        if mixed is not None and self.runner.built and not mixed.attached:
            mixed.attach(optimizer, list(self.model.local_parameters()))
        if self._resume_optimizer_state is not None and self.runner.built:
            sharding = self._state_sharding()
            owned = ({id(hp) for hp, o in zip(sharding.params, sharding.owner) if o == sharding.rank}
                     if sharding is not None else None)
            self._resume_optimizer_state(optimizer, lambda hp: owned is None or id(hp) in owned)
            self._resume_optimizer_state = None
        if mixed is not None and self.runner.built and not mixed.prepare_step():
            self._internals._global_grad_norm = float("inf")  # as DeepSpeed's ZeRO-3 on an overflow
            return  # overflow on some rank: every rank skips this step
        if clip_norm is not None:
            self._clip(clip_norm)
        sharding = self._state_sharding()
        if sharding is not None:  # shard_optimizer_state: ZeRO-1 over the stage's rdp group
            sharding.step(optimizer)
        else:
            optimizer.step()
        if mixed is not None and mixed.attached:
            mixed.finish_step()

    def _clip(self, max_norm: float) -> None:
        """The norm over all stages' parameters (fp32 masters under fp16/bf16)."""
        from smp_adapter.runtime.engines.pipeline.tied import clip_grad_norm_pipeline

        mixed = self._mixed
        masters = mixed.masters_by_param() if mixed is not None and mixed.attached else None
        self._internals._global_grad_norm = clip_grad_norm_pipeline(self.runner, max_norm, masters)

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` in a script or the Trainer
        (runtime/clipping.py routes it here): the gradients the model holds now, by the norm over all stages."""
        if self._mixed is not None and self.job.cfg.fp16:
            from smp_adapter.errors import UnsupportedFeatureError

            raise UnsupportedFeatureError(
                "torch.nn.utils.clip_grad_norm_ on the model with fp16 at pipeline_parallel_degree > 1: the model's "
                "gradients are still multiplied by the loss scale then. Use optimizer.clip_master_grads(max_norm) "
                "(the Hugging Face Trainer does under fp16): it clips the unscaled fp32 master gradients")
        from smp_adapter.runtime.engines.pipeline.tied import clip_grad_norm_pipeline

        norm = clip_grad_norm_pipeline(self.runner, max_norm, only={id(p) for p in params})
        self._internals._global_grad_norm = norm  # what clip_master_grads records, for the same logs
        return norm

    def _state_sharding(self):
        """shard_optimizer_state with rdp > 1: the owner of each stage parameter's state
        (runtime/engines/pipeline/sharded_optimizer.py), set up at the first step (after partitioning)."""
        dims = self.job.dims
        if dims.zero_stage == 0 or dims.rdp == 1 or not self.runner.built:
            return None  # (before the first step there are no stages and no gradients)
        if self._sharding is None:
            from smp_adapter.runtime.engines.pipeline.sharded_optimizer import PipelineStateSharding

            mixed = self._mixed
            params = mixed.masters if mixed is not None else list(self.model.local_parameters())
            self._sharding = PipelineStateSharding(params, self.job.groups.rdp, dims.rdp)
        return self._sharding

    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        if self._mixed is not None:  # the optimizer holds the fp32 masters: clear the model's gradients too
            self._mixed.zero_model_grads(set_to_none)

    @property
    def overflow(self) -> bool:
        return self._mixed.overflow if self._mixed is not None else False

    @property
    def loss_scale(self) -> float:
        return self._mixed.loss_scale if self._mixed is not None else 1.0

    def optimizer_state_dict(self, optimizer) -> dict:
        if self.job.dims.zero_stage > 0:
            refuse_full_sharded_optimizer_state()
        return optimizer.state_dict()  # this stage's state (other stages' parameters have none)

    def optimizer_local_state_dict(self, optimizer) -> dict:
        return dict(optimizer.state_dict())

    def load_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        mixed = self._mixed
        if mixed is not None and not mixed.attached:  # loaded into the fp32 masters once they exist
            mixed.pending_optimizer_state = sd
        else:
            optimizer.load_state_dict(sd)

    # -- partial checkpoints: one file per stage ---------------------------------------------------
    def save_partial(self, io, optimizer) -> dict:
        from smp_adapter.runtime.engines.pipeline.checkpoint import save_stage, save_universal
        from smp_adapter.runtime.checkpoint import universal
        from smp_adapter.runtime.checkpoint.refs import SavedTensors

        if not universal.enabled() or optimizer is None:
            save_stage(io, self.runner, optimizer)  # same-layout resume only
            return {}
        with SavedTensors(None, Path(io.folder)) as saved:  # the index points into these files
            blob = save_stage(io, self.runner, optimizer, saved)
        return {"universal": save_universal(io, self.runner, optimizer, self._mixed, saved, blob)}

    def load_partial(self, io, optimizer, strict: bool, load_optimizer: bool) -> None:
        from smp_adapter.runtime.engines.pipeline.checkpoint import load_stage

        load_stage(io, self.model, optimizer, strict, load_optimizer, self.job)

    def load_universal(self, folder, universal: dict) -> None:
        from smp_adapter.runtime.engines.pipeline.checkpoint import load_universal

        self._resume_optimizer_state = load_universal(self.runner, folder, universal, self._mixed)


