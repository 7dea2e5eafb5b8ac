"""The DeepSpeed engine (pipeline_parallel_degree 1): ZeRO 0/1/3 (+ hpZ), fp16/bf16, TP layers inside.

smp creates the optimizer *after* the model, while ``deepspeed.initialize`` wants both at once, so
DeepSpeed's engine is built when ``smp.DistributedOptimizer`` is created (or at the first forward
of a model used without an optimizer, e.g. evaluation-only scripts).

Two training styles (smp v1 allows both; docs/runtime.md):
  * smp style: ``model(x)`` and ``model.backward(loss)`` inside an ``@smp.step`` function;
  * plain style: ``model(x)``, ``loss.backward()``, ``optimizer.step()`` outside any step function.
    DeepSpeed's ZeRO-0 engine refuses ``loss.backward()`` on outputs of ``engine(...)``, so in this
    style (ZeRO 0/1) the forward runs the module directly and ``optimizer_step`` all-reduces the
    gradients before updating: same result, same single reduction.

Gradient accumulation: DeepSpeed's gradient_accumulation_steps is microbatches x
backward_passes_per_step (translate/deepspeed.py), so ``engine.backward`` divides each microbatch
loss by that number (= the average over microbatches smp promises). The reduction boundary is set
here explicitly: after the last microbatch of every backward_passes_per_step-th step call, so
gradients are reduced when the step function returns, as smp v1 guarantees.
"""

from __future__ import annotations

import contextlib

import os
from pathlib import Path

import torch

from smp_adapter.errors import SMPCheckpointError, SMPUsageError
from smp_adapter.runtime.engines.base import Engine, refuse_full_sharded_optimizer_state
from smp_adapter.runtime.engines.deepspeed.process_group import StartsThroughDeepSpeed


class DeepSpeedEngine(StartsThroughDeepSpeed, Engine):
    name = "deepspeed"

    # -- before the job exists (a class hook), then before the model exists (ZeRO-3 details in zero3.py) --
    @classmethod
    def build_job_config(cls, dims, backend):
        from smp_adapter.runtime.engines.deepspeed.config import build_job_config

        return build_job_config(dims, backend)

    @classmethod
    def load_code(cls, dims) -> None:
        """ZeRO (stage > 0): DeepSpeed's optimizer check (``is_zero_supported_optimizer``, at
        ``deepspeed.initialize``) imports its Muon optimizer, whose module compiles a kernel with
        ``torch.compile`` at import: ~600 modules (torch._inductor, functorch's partitioners, networkx),
        ~40 MiB of Python objects, measured on deepspeed 0.19.8 / torch 2.13. Loaded here, before any
        model exists, it is not on top of a rank's parameters and gradients at the optimizer's wrap."""
        if dims.zero_stage > 0:
            try:
                import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
            except ImportError:  # a DeepSpeed without Muon: its check imports nothing either
                pass

    def materialize_kept(self, module, device) -> None:
        """ZeRO-3: the delayed model is materialised module by module, each partitioned at once
        (zero3.materialize_into_shards); otherwise every tensor, as on any whole-tensor engine."""
        if self.job.dims.zero_stage != 3:
            return super().materialize_kept(module, device)
        from smp_adapter.runtime.engines.base import model_dtype
        from smp_adapter.runtime.engines.deepspeed.zero3 import materialize_into_shards

        materialize_into_shards(module, device, model_dtype(self.job.cfg) or torch.get_default_dtype(), self.job)

    def register_external_parameter(self, module, parameter) -> None:
        if self.job.dims.zero_stage == 3:
            from smp_adapter.runtime.engines.deepspeed import zero3

            zero3.register_external_parameter(module, parameter)

    def is_own_parameter(self, param) -> bool:
        from smp_adapter.runtime.engines.deepspeed.zero3 import is_zero3_parameter

        return is_zero3_parameter(param)

    def local_data(self, tensor):
        from smp_adapter.runtime.engines.deepspeed.zero3 import is_zero3_parameter, shard_values

        return shard_values(tensor) if is_zero3_parameter(tensor) else tensor

    def gathered(self, params, modifier_rank=None):
        from smp_adapter.runtime.engines.deepspeed import zero3

        return zero3.gathered(params, modifier_rank)

    def attach_model(self, model, tp_originals: dict) -> None:
        super().attach_model(model, tp_originals)
        job = self.job
        self._ds = None  # deepspeed.DeepSpeedEngine, built lazily (module docstring)
        self._client_optimizer = None
        self._plain_backward_pending = False
        self._reduce_after_backward = True
        # Without prescaled_batch each TP rank trains on its own samples, so replicated parameters
        # must also be averaged over the TP group before DeepSpeed averages over RDP: we then own
        # the reduction (see _reduce_gradients).
        self._manual_reduction = job.dims.tp > 1 and not job.cfg.prescaled_batch
        self._floating_buffers = [b for b in model.module.buffers() if b.is_floating_point()]
        self._clip_at_step = None  # torch's clip_grad_norm_ on the model, carried out by DeepSpeed's optimizer
        if job.dims.tp > 1 or job.dims.sdp > 1:  # a rank holds part of the model's gradients
            from smp_adapter.runtime.clipping import route_torch_clipping

            route_torch_clipping(self)
        if job.dims.zero_stage == 3:
            from smp_adapter.runtime.engines.base import model_dtype
            from smp_adapter.runtime.engines.deepspeed.zero3 import partition_for_zero3

            # scripts read p.ds_tensor right after wrapping; shards in the job's dtype
            partition_for_zero3(model.module, model_dtype(job.cfg) or torch.get_default_dtype(), job)

    # -- DeepSpeed's engine ----------------------------------------------------------------------
    @property
    def deepspeed_engine(self):
        if self._ds is None:
            self._ds = self._build(None, None)  # no optimizer: evaluation-only use
            self.model.mark_partitioned()
        return self._ds

    def attach_optimizer(self, optimizer, loss_scale) -> None:
        if self._ds is not None:
            raise SMPUsageError("smp.DistributedOptimizer must be created before the model's first forward pass "
                                "(create it right after smp.DistributedModel)")
        self._client_optimizer = optimizer
        self._ds = self._build(optimizer, loss_scale)
        self.model.mark_partitioned()

    def _build(self, optimizer, loss_scale):
        import deepspeed

        from smp_adapter.runtime.engines.deepspeed.config import engine_config
        from smp_adapter.runtime.engines.deepspeed.groups import adopt_smp_hpz_group, mpu_or_none

        config = engine_config(self.job, loss_scale, self.model.backward_passes_per_step)
        module = self.model.module
        config = _with_bounded_buffers(config, module, self.job)
        params = [p for p in module.parameters() if p.requires_grad] if optimizer is None else None
        from smp_adapter.runtime.engines.deepspeed.zero3 import (fp32_master_shared_with_partition,
                                                                 step_on_gradient_partitions_in_place)

        adopt_smp_hpz_group(self.job)
        zero3 = self.job.dims.zero_stage == 3
        sharing = fp32_master_shared_with_partition() if zero3 else contextlib.nullcontext()
        with sharing:  # an fp32 job's optimizer steps the partition itself (no second fp32 copy)
            engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                                   mpu=mpu_or_none(self.job), model_parameters=params,
                                                   dist_init_required=False)
        if zero3 and hasattr(engine.optimizer, "_prepare_fp32_grad_for_sub_group"):
            step_on_gradient_partitions_in_place(engine.optimizer)  # no flattened copy of the gradients per step
        return engine

    # -- model -----------------------------------------------------------------------------------
    def run_step(self, func, bound_mbs: list, detach: bool) -> list:
        from smp_adapter.runtime.step import run_microbatches

        return run_microbatches(func, bound_mbs, before_each=self._before_microbatch)

    def _before_microbatch(self, mb: int, num_microbatches: int) -> None:
        """Reduce gradients only after the last microbatch of every backward_passes_per_step-th call."""
        last_call = (self.progress.step_calls + 1) % self.model.backward_passes_per_step == 0
        self._reduce_after_backward = last_call and mb == num_microbatches - 1
        if self._ds is not None:
            self._ds.set_gradient_accumulation_boundary(self._reduce_after_backward and not self._manual_reduction)

    def forward(self, args, kwargs):
        engine, model = self.deepspeed_engine, self.model
        if model.training and model.broadcast_buffers and self._floating_buffers:
            _broadcast_buffers(self._floating_buffers, self.job)
        if self.progress.in_step:
            return engine(*args, **kwargs)
        # plain style (loss.backward() outside @smp.step): gradients are reduced in the next optimizer.step()
        if torch.is_grad_enabled() and model.training:
            self._plain_backward_pending = True
            if engine.zero_optimization_stage() < 3:
                # DeepSpeed's own hooks on engine outputs would reduce (or, for ZeRO 0, refuse)
                # a direct loss.backward(); run the module and reduce in optimizer.step()
                engine.set_gradient_accumulation_boundary(False)
                return model.module(*args, **kwargs)
            engine.set_gradient_accumulation_boundary(True)
        return engine(*args, **kwargs)

    def backward(self, loss) -> None:
        if self._client_optimizer is None:  # DeepSpeed would fail with "must provide optimizer during init"
            raise SMPUsageError(
                "model.backward() needs an optimizer: wrap it with smp.DistributedOptimizer(optimizer) right after "
                "smp.DistributedModel, before the first step")
        engine = self.deepspeed_engine
        reduce_now = self._reduce_after_backward if self.progress.in_step else True
        engine.set_gradient_accumulation_boundary(reduce_now and not self._manual_reduction)
        engine.backward(loss, scale_wrt_gas=self.model.average_grads_across_microbatches)
        if reduce_now and self._manual_reduction:
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        """Average gradients over data-parallel ranks now: replicated parameters over the TP group
        first when each TP rank had its own samples, then everything over DeepSpeed's group."""
        engine = self.deepspeed_engine
        if self._manual_reduction:
            from smp_adapter.parallel.tensor import current_tp_context, tp_gradient_sync

            tp_gradient_sync(self.model.module.parameters(), current_tp_context())
        engine.set_gradient_accumulation_boundary(True)
        engine.allreduce_gradients()

    # -- partial model state dicts: ZeRO-3 shards, else whole tensors ---------------------------
    def local_tensors(self) -> dict:
        from smp_adapter.runtime.engines.deepspeed import zero3

        module = self.model.module
        return zero3.local_tensors(module) if self.holds_shards(module) else super().local_tensors()

    def load_local_state_dict(self, sd: dict, strict: bool):
        from smp_adapter.runtime.engines.deepspeed import zero3

        if not self.holds_shards(self.model.module):
            return super().load_local_state_dict(sd, strict)
        zero3.load_local_shards(self.model.module, sd)
        return None

    def local_named_parameters(self):
        return self.model.module.named_parameters()  # pp = 1: every module is on this rank

    def local_named_buffers(self):
        return self.model.module.named_buffers()

    def local_named_modules(self):
        return self.model.module.named_modules()

    # -- optimizer -------------------------------------------------------------------------------
    @property
    def ready_for_checkpoint(self) -> bool:
        return self._ds is not None

    def optimizer_step(self, optimizer, clip_norm) -> None:
        engine = self.deepspeed_engine
        if self._plain_backward_pending and engine.zero_optimization_stage() < 3:
            self._reduce_gradients()  # plain style: gradients were only local so far
        self._plain_backward_pending = False
        if clip_norm is not None:
            self._clip(clip_norm)
        engine.set_gradient_accumulation_boundary(True)
        inner, pending, self._clip_at_step = engine.optimizer, self._clip_at_step, None
        if pending is None:
            engine.step()
            return
        configured, inner.clip_grad = inner.clip_grad, pending  # this step only (the config's value after it)
        try:
            engine.step()
        finally:
            inner.clip_grad = configured

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` on the model (runtime/clipping.py routes it here). A plain optimizer
        holds whole gradients: clipped now by the norm over the TP shards. DeepSpeed's ZeRO / fp16 optimizers
        hold them in their partitions: DeepSpeed clips by its global norm in this step's update (``clip_grad``
        for the step); the norm returned is read from the partitions (ZeRO-3: zero3.py; ZeRO-1/2: DeepSpeed's
        own rule), and only in the step under the fp16/bf16 optimizers without ZeRO (nan here)."""
        import math

        from smp_adapter.runtime.clipping import clip_by_global_norm

        only = {id(p) for p in params}
        mine = [p for p in self.model.module.parameters() if id(p) in only]
        engine = self.deepspeed_engine
        if self._plain_backward_pending and engine.zero_optimization_stage() < 3:
            self._reduce_gradients()  # plain style: clipped as the whole batch's gradients, as in one process
            self._plain_backward_pending = False
        inner = engine.optimizer
        tp_group = self.job.groups.tp if self.job.dims.tp > 1 else None
        if not hasattr(inner, "clip_grad"):
            grads = [(p.grad, self.model.is_distributed_parameter(p), True) for p in mine if p.grad is not None]
            return clip_by_global_norm(grads, max_norm, tp_group=tp_group)
        if not math.isinf(max_norm):  # (inf: the Trainer asks for the norm only)
            self._clip_at_step = max_norm
        if engine.zero_optimization_stage() == 3:
            from smp_adapter.runtime.engines.deepspeed.zero3 import local_gradient_norm

            return local_gradient_norm(mine, self.model.is_distributed_parameter, tp_group, self.job.groups.rdp)
        if hasattr(inner, "scaled_global_norm") and hasattr(inner, "averaged_gradients"):
            # ZeRO-1/2: this rank's partition of the reduced gradients, which DeepSpeed's step will read;
            # its own norm rule (all-reduced over the data-parallel and TP groups), unscaled as the step does
            return float(inner.scaled_global_norm()) / float(getattr(inner, "loss_scale", 1.0) or 1.0)
        self.warn_once(["torch.nn.utils.clip_grad_norm_ on the model under DeepSpeed's fp16/bf16 optimizer without ZeRO: "
                        "DeepSpeed clips by the global norm in the next optimizer.step(); the norm is known only then, "
                        "so the call returns nan (read it after the step as optimizer._global_grad_norm)"], self.job.rank)
        return float("nan")

    def _clip(self, max_norm: float) -> None:
        inner = self.deepspeed_engine.optimizer
        module = self.model.module
        if hasattr(inner, "clip_grad"):  # DeepSpeed fp16 / ZeRO optimizers clip master grads in step()
            inner.clip_grad = max_norm
        elif self.job.dims.tp > 1:  # the same factor on every TP rank (runtime/clipping.py)
            from smp_adapter.runtime.clipping import clip_by_global_norm

            grads = [(p.grad, self.model.is_distributed_parameter(p), True) for p in module.parameters()
                     if p.grad is not None]
            clip_by_global_norm(grads, max_norm, tp_group=self.job.groups.tp)
        else:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        engine = self.deepspeed_engine
        if engine.zero_optimization_stage() > 0 or engine.fp16_enabled() or engine.bfloat16_enabled():
            engine.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def skips_non_finite_steps(self) -> str | None:
        engine = self.deepspeed_engine
        if engine.zero_optimization_stage() == 3 or engine.fp16_enabled():  # they check gradients for overflow
            return "engine"
        # ZeRO 1/2 keep the reduced gradient partitions until their next update: nothing to drop them by
        # (and bf16's optimizer keeps fp32 gradient accumulators the same way)
        return "drop" if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled() else None

    @property
    def overflow(self) -> bool:
        return bool(getattr(getattr(self._ds, "optimizer", None), "overflow", False))

    @property
    def loss_scale(self) -> float:
        inner = getattr(self._ds, "optimizer", None)
        return float(getattr(inner, "cur_scale", getattr(inner, "loss_scale", 1.0)) or 1.0)

    @property
    def optimizer_internals(self):
        wrapper = getattr(self._ds, "optimizer", None)
        return wrapper if wrapper is not self._client_optimizer else None

    def param_shard_group(self):
        group = getattr(self.optimizer_internals, "dp_process_group", None)
        if group is None or self._ds.zero_optimization_stage() != 3:
            return super().param_shard_group()
        return group

    def optimizer_state_dict(self, optimizer) -> dict:
        if self.deepspeed_engine.zero_optimization_stage() > 0:
            refuse_full_sharded_optimizer_state()
        return self.deepspeed_engine.optimizer.state_dict()

    def optimizer_local_state_dict(self, optimizer) -> dict:
        return dict(self.deepspeed_engine.optimizer.state_dict())

    def load_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        engine = self.deepspeed_engine
        if engine.zero_optimization_stage() > 0:
            engine.optimizer.load_state_dict([sd], load_optimizer_states=True)
        else:
            engine.optimizer.load_state_dict(sd)

    # -- partial checkpoints: DeepSpeed's own format under <tag>_partial/ds, and layout-independent
    # pieces under <tag>_partial/universal (runtime/engines/deepspeed/universal_checkpoint.py) ----------------------
    def save_partial(self, io, optimizer) -> dict:
        from smp_adapter.runtime.checkpoint import universal
        from smp_adapter.runtime.engines.deepspeed import universal_checkpoint
        from smp_adapter.runtime.checkpoint.refs import SavedTensors

        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        staging, checkpoint_engine = Path(io.folder), self._ds.checkpoint_engine
        # the files DeepSpeed writes for this rank are hashed as they are written (its default engine)
        # a write that fails (disk full) does not raise inside DeepSpeed's save, whose collectives the other
        # ranks are in: kept in io.failures, raised on every rank by checkpoint/dirs.py once this returned
        with io.noting_saves(checkpoint_engine, type(checkpoint_engine).save is TorchCheckpointEngine.save), \
                io.keeping_failures(self._ds, "_copy_recovery_script"):  # rank 0's copy of zero_to_fp32.py
            if not universal.enabled():
                self._ds.save_checkpoint(str(staging), tag="ds", save_latest=False)
            else:
                with SavedTensors(self._ds, Path(staging)) as saved:  # the index points into these files
                    self._ds.save_checkpoint(str(staging), tag="ds", save_latest=False)
        return {} if not universal.enabled() else \
            {"universal": universal_checkpoint.save(self._ds, self.model.module, io, self.job, saved)}

    def load_universal(self, folder, universal: dict) -> None:
        from smp_adapter.runtime.engines.deepspeed import universal_checkpoint

        universal_checkpoint.load(self._ds, self.model.module, Path(folder), universal, self.job)

    def load_partial(self, io, optimizer, strict: bool, load_optimizer: bool) -> None:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        folder, checkpoint_engine = io.folder, self._ds.checkpoint_engine
        read = checkpoint_engine.load
        # its default engine (torch.load(path)) is handed a file object that hashes what it reads
        # for the resume's check (io.source); any other engine reads its path
        torch_load_engine = type(checkpoint_engine).load is TorchCheckpointEngine.load

        def load(path, *args, **kwargs):
            try:
                if torch_load_engine:
                    with io.source(path, _shared_by(path, self.job)) as source:
                        return read(source, *args, **kwargs)
                return read(path, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - torch's reader on a file cut short: "[Errno 22] Invalid argument"
                raise SMPCheckpointError(  # read unchecked (the opt-out): still name the file, never a bare OSError
                    f"DeepSpeed could not read {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): "
                    f"the file is damaged or cut short; run `smp-adapter checkpoint verify {folder}`, or resume an "
                    "older tag") from None

        had_own = "load" in vars(checkpoint_engine)
        checkpoint_engine.load = load  # an instance attribute for this load only
        try:
            loaded, _ = self._ds.load_checkpoint(str(folder), tag="ds", load_module_strict=strict,
                                                 load_optimizer_states=load_optimizer,
                                                 load_lr_scheduler_states=load_optimizer)
        finally:
            if had_own:
                checkpoint_engine.load = read
            else:
                del checkpoint_engine.load
        if loaded is None:
            raise SMPCheckpointError(f"DeepSpeed could not load {folder}/ds: the checkpoint is incomplete")


def _shared_by(path, job) -> tuple[int, int]:
    """Who reads a DeepSpeed file whole on a same-layout resume: ``mp_rank_XX_model_states.pt`` (ZeRO
    0/1/2's module weights, and ZeRO 0's optimizer state) by every rank of the rdp group (the same
    tp coordinate), so each hashes its every rdp-th chunk; ZeRO-3's and the optimizer's files
    (``zero_pp_rank_...``) by their own rank alone."""
    if os.path.basename(str(path)).startswith("mp_rank_"):
        return job.coord.rdp, job.dims.rdp
    return 0, 1


def _broadcast_buffers(buffers, job) -> None:
    """broadcast_buffers=True (DDP behaviour, smp v1's ddp option): floating buffers (BatchNorm statistics)
    follow dp rank 0 at every training forward."""
    from smp_adapter.runtime.engines.whole_tensors import broadcast_from_first_rank

    broadcast_from_first_rank(buffers, job.groups.dp, job.device)


def _with_bounded_buffers(config: dict, module, job) -> dict:
    """ZeRO-3's default buffers bounded by the model (translate/deepspeed.bounded_zero3_buffers); rank 0
    says once what it bounded."""
    import sys

    from smp_adapter.runtime.engines.deepspeed.zero3 import is_zero3_parameter
    from smp_adapter.translate.deepspeed import bounded_zero3_buffers

    largest = max((p.ds_numel if is_zero3_parameter(p) else p.numel() for p in module.parameters()), default=0)
    config, changed = bounded_zero3_buffers(config, job.cfg, largest)
    if changed and job.rank == 0:  # information, not a warning: the job does what explain says
        print(f"smp-adapter: ZeRO-3 buffers bounded by the model (its largest parameter, {largest} elements): "
              + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
              + " (sdp_reduce_bucket_size in the smp options sets the reduce bucket)", file=sys.stderr)
    return config
