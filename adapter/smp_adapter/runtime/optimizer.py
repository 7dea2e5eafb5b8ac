"""``smp.DistributedOptimizer`` (spec §2.8): the smp surface over DeepSpeed's optimizer.

Creating it builds the DeepSpeed engine (ZeRO stage from the options, fp16 loss scaling from the
arguments here). It subclasses ``torch.optim.Optimizer`` so torch LR schedulers accept it;
``.optimizer`` is the client optimizer (what smp v1 tells users to give LR schedulers), and any
attribute it does not define falls through to that optimizer.
"""

from __future__ import annotations

import torch

from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError
from smp_adapter.runtime.state import require_initialized, state
from smp_adapter.translate.deepspeed import DEFAULT_DYNAMIC_LOSS_ARGS, LossScaleArgs


def _loss_scale_args(static_loss_scale, dynamic_loss_scale, dynamic_loss_args, extra) -> LossScaleArgs:
    # smp v1 docs spell the arguments both ways, and pass dynamic_loss_args as one dict (spec §5.7)
    if "static_loss_scaling" in extra:
        static_loss_scale = extra.pop("static_loss_scaling")
    if "dynamic_loss_scaling" in extra:
        dynamic_loss_scale = extra.pop("dynamic_loss_scaling")
    args = dict(dynamic_loss_args or {})
    args.update(extra)
    unknown = set(args) - set(DEFAULT_DYNAMIC_LOSS_ARGS)
    if unknown:
        raise SMPUsageError(f"DistributedOptimizer: unknown dynamic loss scale argument(s) {sorted(unknown)}; "
                            f"allowed: {sorted(DEFAULT_DYNAMIC_LOSS_ARGS)}")
    return LossScaleArgs(static_loss_scale=static_loss_scale, dynamic_loss_scale=bool(dynamic_loss_scale),
                         **{**DEFAULT_DYNAMIC_LOSS_ARGS, **args})


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None, **kwargs):
        s = require_initialized("DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SMPUsageError(f"smp.DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise SMPUsageError("this optimizer is already an smp.DistributedOptimizer: wrap the torch optimizer once")
        if s.model is None:
            raise SMPUsageError("create smp.DistributedModel first, then build the optimizer from the wrapped model's "
                                "parameters and wrap it in smp.DistributedOptimizer (smp v1 order)")
        if s.optimizer is not None:
            raise SMPUsageError("only one smp.DistributedOptimizer per script: reuse the existing one")
        loss_scale = _loss_scale_args(static_loss_scale, dynamic_loss_scale, dynamic_loss_args, dict(kwargs))
        _check_unique_params(optimizer)
        from smp_adapter.runtime.engine import build_engine

        # no Optimizer.__init__: state and param_groups belong to the client optimizer (properties below)
        self.__dict__["optimizer"] = optimizer
        self.__dict__["_model"] = s.model
        # pp > 1 with fp16/bf16: fp32 masters and loss scaling (smp_adapter/pipeline/mixed_precision.py)
        self.__dict__["mixed_precision"] = None
        if s.model._pipeline is None:
            s.model._attach_engine(build_engine(s.model, optimizer, loss_scale))
        # pp > 1: no DeepSpeed engine; the pipeline reduces gradients in the step, step() updates;
        # fp16/bf16 masters and loss scaling are smp_adapter/pipeline/mixed_precision.py
        elif s.cfg.fp16 or s.cfg.bf16:
            from smp_adapter.pipeline.mixed_precision import PipelineMixedPrecision

            self.__dict__["mixed_precision"] = PipelineMixedPrecision(torch.float16 if s.cfg.fp16 else torch.bfloat16,
                                                             loss_scale)
        self.__dict__["_clip_norm"] = None
        s.optimizer = self

    # -- torch.optim.Optimizer surface -----------------------------------------------------------
    @property
    def engine(self):
        return self._model._engine

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def ds_param_shard_group(self):
        """smp v1's name for the process group over which ZeRO-3 parameter shards (``p.ds_tensor``)
        are spread: scripts all-reduce per-shard norms over it. Sharded data parallel only."""
        wrapper = getattr(self.engine, "optimizer", None) if self._model._engine is not None else None
        group = getattr(wrapper, "dp_process_group", None)
        if group is None or self._model._engine.zero_optimization_stage() != 3:
            raise AttributeError("ds_param_shard_group exists only with sharded_data_parallel_degree > 1 (ZeRO-3 "
                                 "parameter shards); without it every rank holds whole parameters")
        return group

    def __getattr__(self, name):
        # smp v1's sharded data parallel *was* DeepSpeed, and scripts read its ZeRO optimizer's
        # internals through smp's optimizer (fp32_partitioned_groups_flat, ...): DeepSpeed's
        # optimizer answers first, then the torch optimizer.
        d = self.__dict__
        if "optimizer" not in d:  # during construction
            raise AttributeError(name)
        model = d.get("_model")
        engine = getattr(model, "_engine", None) if model is not None else None
        wrapper = getattr(engine, "optimizer", None)
        if wrapper is not None and wrapper is not d["optimizer"]:
            try:
                return getattr(wrapper, name)
            except AttributeError:
                pass
        return getattr(d["optimizer"], name)

    def __repr__(self):
        return f"smp.DistributedOptimizer({self.optimizer!r})"

    def step(self, closure=None):
        if closure is not None:
            raise SMPUsageError("DistributedOptimizer.step does not take a closure: compute the loss in the step function")
        if state.in_step:
            raise SMPUsageError("optimizer.step() was called inside an @smp.step function; call it after the step "
                                "function returns (gradients are complete only then)")
        engine, model = self.engine, self._model
        if model._pipeline is not None:
            self._pipeline_step()
            self.__dict__["_clip_norm"] = None
            for hook in list(model._post_step_hooks):
                hook(model, self)
            return
        if model._plain_backward_pending and engine.zero_optimization_stage() < 3:
            model._reduce_gradients()  # plain style: gradients were only local so far
        model._plain_backward_pending = False
        if self._clip_norm is not None:
            self._apply_clip(self._clip_norm)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        self.__dict__["_clip_norm"] = None
        for hook in list(model._post_step_hooks):
            hook(model, self)

    def _pipeline_step(self) -> None:
        """pp > 1: (fp16/bf16: overflow check, unscaled fp32 master gradients) -> clipping -> the
        torch optimizer, ZeRO-1 sharded with shard_optimizer_state -> (masters back into the model)."""
        mixed = self.mixed_precision
        if mixed is not None and self._model._pipeline.built:
            if not mixed.attached:
                mixed.attach(self.optimizer, list(self._model.local_parameters()))
            if not mixed.prepare_step():
                return  # overflow on some rank: every rank skips this step
        if self._clip_norm is not None:
            self._apply_clip(self._clip_norm)
        sharding = self._pipeline_state_sharding()
        if sharding is not None:  # shard_optimizer_state: ZeRO-1 over the stage's rdp group
            sharding.step(self.optimizer)
        else:
            self.optimizer.step()
        if mixed is not None and mixed.attached:
            mixed.finish_step()

    def _pipeline_state_sharding(self):
        """pp > 1 with shard_optimizer_state and rdp > 1: the owner of each stage parameter's state
        (smp_adapter/pipeline/sharded_optimizer.py), set up at the first step (after partitioning)."""
        if state.dims.zero_stage == 0 or state.dims.rdp == 1 or not self._model._pipeline.built:
            return None  # (before the first step there are no stages and no gradients)
        if "_sharding" not in self.__dict__:
            from smp_adapter.pipeline.sharded_optimizer import PipelineStateSharding

            mixed = self.mixed_precision
            params = mixed.masters if mixed is not None else list(self._model.local_parameters())
            self.__dict__["_sharding"] = PipelineStateSharding(params, state.groups.rdp, state.dims.rdp)
        return self.__dict__["_sharding"]

    def zero_grad(self, set_to_none: bool = True):
        engine = self.engine
        if engine is None:  # pp > 1
            self.optimizer.zero_grad(set_to_none=set_to_none)
            mixed = self.mixed_precision
            if mixed is not None:  # the optimizer holds the fp32 masters: clear the model's gradients too
                mixed.zero_model_grads(set_to_none)
        elif engine.zero_optimization_stage() > 0 or engine.fp16_enabled() or engine.bfloat16_enabled():
            engine.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- smp extras ------------------------------------------------------------------------------
    def clip_master_grads(self, max_norm: float):
        """Clip the gradient norm at the next step() (on fp32 master gradients under fp16/bf16/ZeRO)."""
        self.__dict__["_clip_norm"] = float(max_norm)

    def _apply_clip(self, max_norm: float) -> None:
        engine = self.engine
        inner = engine.optimizer if engine is not None else None
        if engine is None:  # pp > 1: the norm over all stages' parameters (fp32 masters under fp16/bf16)
            from smp_adapter.pipeline.runtime import clip_grad_norm_pipeline

            mixed = self.mixed_precision
            masters = dict(zip(map(id, mixed.params), mixed.masters)) if mixed is not None and mixed.attached else None
            clip_grad_norm_pipeline(self._model, max_norm, masters)
        elif hasattr(inner, "clip_grad"):  # DeepSpeed fp16 / ZeRO optimizers clip master grads in step()
            inner.clip_grad = max_norm
        elif state.dims.tp > 1:  # the same factor on every TP rank (runtime/clipping.py)
            from smp_adapter.runtime.clipping import clip_by_global_norm

            model = self._model
            grads = [(p.grad, model.is_distributed_parameter(p), True) for p in model.module.parameters()
                     if p.grad is not None]
            clip_by_global_norm(grads, max_norm, tp_group=state.groups.tp)
        else:
            torch.nn.utils.clip_grad_norm_(self._model.module.parameters(), max_norm)

    @property
    def overflow(self) -> bool:
        """Whether the last step() was skipped because fp16 gradients overflowed."""
        mixed = self.mixed_precision
        if mixed is not None:
            return mixed.overflow
        return bool(getattr(getattr(self.engine, "optimizer", None), "overflow", False))

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        mixed = self.mixed_precision
        if mixed is not None:
            return mixed.loss_scale
        inner = getattr(self.engine, "optimizer", None)
        return float(getattr(inner, "cur_scale", getattr(inner, "loss_scale", 1.0)) or 1.0)

    def state_dict(self):
        sharded = (self.engine.zero_optimization_stage() if self.engine is not None else state.dims.zero_stage) > 0
        if self.engine is None and not sharded:  # pp > 1: this stage's state (other stages' parameters have none)
            return self.optimizer.state_dict()
        if sharded:
            raise UnsupportedFeatureError(
                "a full optimizer state_dict is not available with optimizer-state sharding (as in smp v1): use "
                "optimizer.local_state_dict() or smp.save_checkpoint(..., partial=True)")
        return self.engine.optimizer.state_dict()

    def local_state_dict(self, gather_if_shard: bool = False):
        sd = dict((self.engine.optimizer if self.engine is not None else self.optimizer).state_dict())
        sd["_smp_is_partial"] = True
        return sd

    def load_state_dict(self, state_dict):
        sd = dict(state_dict)
        sd.pop("_smp_is_partial", None)
        engine = self.engine
        mixed = self.mixed_precision
        if mixed is not None and not mixed.attached:  # loaded into the fp32 masters once they exist
            mixed.pending_optimizer_state = sd
        elif engine is None:
            self.optimizer.load_state_dict(sd)
        elif engine.zero_optimization_stage() > 0:
            engine.optimizer.load_state_dict([sd], load_optimizer_states=True)
        else:
            engine.optimizer.load_state_dict(sd)


def _check_unique_params(optimizer) -> None:
    seen = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise SMPUsageError("the optimizer holds the same parameter twice (tied weights?): build it from "
                                    "model.parameters(), which lists each parameter once")
            seen.add(id(p))
