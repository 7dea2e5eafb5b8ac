"""``smp.DistributedOptimizer``: the smp surface over the engine's optimizer.

Creating it attaches the optimizer to the model's engine (runtime/engines): at pp = 1 that builds
DeepSpeed's engine (ZeRO stage from the options, fp16 loss scaling from the arguments here). The
update, clipping, zero_grad and state dicts are the engine's. It subclasses ``torch.optim.Optimizer`` so torch LR schedulers accept it;
``.optimizer`` is the client optimizer (what smp v1 tells users to give LR schedulers), and any
attribute it does not define falls through to that optimizer.
"""

from __future__ import annotations

import torch

from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError
from smp_adapter.ledger import record as comm_ledger
from smp_adapter.runtime.state import PRE_1_10_FP16, require_initialized, state
from smp_adapter.translate.deepspeed import DEFAULT_DYNAMIC_LOSS_ARGS, LossScaleArgs


def _loss_scale_args(static_loss_scale, dynamic_loss_scale, dynamic_loss_args, extra) -> LossScaleArgs:
    # smp v1 docs spell the arguments both ways, and pass dynamic_loss_args as one dict
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
    # torch's GradScaler.step hands a fused optimizer the scale to unscale by itself (``grad_scale`` /
    # ``found_inf`` set as attributes of the object it is given) when this answers True. Given this
    # wrapper, those land here, not on the torch optimizer, whose step would then apply scaled gradients;
    # and smp.amp.GradScaler's unscale_ is where ranks agree on overflows. False: unscale_, then step.
    _step_supports_amp_scaling = False

    def __init__(self, optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None, **kwargs):
        s = require_initialized("DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            if "fp16" in type(optimizer).__name__.lower():  # smp < 1.10 scripts wrapped their own FP16_Optimizer
                raise UnsupportedFeatureError(f"smp.DistributedOptimizer({type(optimizer).__name__}): {PRE_1_10_FP16}")
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
        # no Optimizer.__init__: state and param_groups belong to the client optimizer (properties below)
        self.__dict__["optimizer"] = optimizer
        self.__dict__["_model"] = s.model
        self.__dict__["_engine"] = s.model.runtime_engine
        from smp_adapter.compat.fused_optimizers import prefer_fused

        prefer_fused(optimizer)  # torch Adam/AdamW on CUDA: the fused kernel where the script chose none
        self._engine.attach_optimizer(optimizer, loss_scale)  # DeepSpeed: builds its engine now
        self.__dict__["_clip_norm"] = None
        s.optimizer = self

    # -- torch.optim.Optimizer surface -----------------------------------------------------------
    @property
    def engine(self):
        """DeepSpeed's engine at pp = 1, None at pp > 1 (as ``model.engine``)."""
        return self._model.engine

    @property
    def mixed_precision(self):
        """pp > 1 with fp16/bf16: the fp32 masters and loss scaler (runtime/engines/pipeline/mixed_precision.py), else None."""
        return self._engine.mixed_precision

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
        return self._engine.param_shard_group()

    def __getattr__(self, name):
        # smp v1's sharded data parallel *was* DeepSpeed, and scripts read its ZeRO optimizer's
        # internals through smp's optimizer (fp32_partitioned_groups_flat, ...): DeepSpeed's
        # optimizer answers first, then the torch optimizer.
        d = self.__dict__
        if "optimizer" not in d:  # during construction
            raise AttributeError(name)
        internals = d["_engine"].optimizer_internals if "_engine" in d else None
        if internals is not None:
            try:
                return getattr(internals, name)
            except AttributeError:
                pass
        return getattr(d["optimizer"], name)

    def __repr__(self):
        return f"smp.DistributedOptimizer({self.optimizer!r})"

    def step(self, closure=None):
        if closure is not None:
            raise SMPUsageError("DistributedOptimizer.step does not take a closure: compute the loss in the step function")
        if state.progress.in_step:
            raise SMPUsageError("optimizer.step() was called inside an @smp.step function; call it after the step "
                                "function returns (gradients are complete only then)")
        guard = self._model.step_guard
        update = guard.before_update()  # the step's losses finite on every rank (runtime/finiteness.py)
        if update or self._engine.skips_non_finite_steps == "engine":
            # (skipping under ZeRO-3 / fp16: DeepSpeed sees the NaN gradients and skips the update itself)
            self._engine.optimizer_step(self.optimizer, self._clip_norm)
        elif self._engine.skips_non_finite_steps == "drop":
            self._engine.zero_grad(self.optimizer, True)
        else:
            raise SMPUsageError(f"optimizer step {guard.step}: the loss is not finite, and {guard.policy.action!r} "
                                "cannot skip an update under ZeRO stage 1/2 without fp16 (DeepSpeed keeps the "
                                "reduced gradients until its next update): the job stops. Use "
                                "SMP_ADAPTER_NON_FINITE=stop, or sharded_data_parallel_degree (ZeRO-3)")
        guard.after_update(self._engine.overflow, updated=update)
        self.__dict__["_clip_norm"] = None
        if update:
            self._model.run_post_step_hooks(self)
        comm_ledger.note_optimizer_step()  # the training step's traffic ends here (ledger/record.py)

    def zero_grad(self, set_to_none: bool = True):
        self._engine.zero_grad(self.optimizer, set_to_none)
        self._model.step_guard.forget_losses()

    # -- smp extras ------------------------------------------------------------------------------
    def clip_master_grads(self, max_norm: float):
        """Clip the gradient norm at the next step() (on fp32 master gradients under fp16/bf16/ZeRO)."""
        self.__dict__["_clip_norm"] = float(max_norm)

    @property
    def overflow(self) -> bool:
        """Whether the last step() was skipped because fp16 gradients overflowed."""
        return self._engine.overflow

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._engine.loss_scale

    def state_dict(self):
        return self._engine.optimizer_state_dict(self.optimizer)

    def local_state_dict(self, gather_if_shard: bool = False):
        sd = self._engine.optimizer_local_state_dict(self.optimizer)
        sd["_smp_is_partial"] = True
        return sd

    def load_state_dict(self, state_dict):
        sd = dict(state_dict)
        sd.pop("_smp_is_partial", None)
        self._engine.load_optimizer_state_dict(self.optimizer, sd)

    # smp 1.10's checkpoint helpers, which the DLC GPT-2 test script calls
    def save_optimizer_backcompat(self, cast_to_cpu: bool = True, gather_if_shard: bool = True,
                                  fp32_states_only: bool = False):
        """The optimizer state in smp's pre-1.10 form: the whole state (``gather_if_shard=True``; under
        optimizer-state sharding that raises, as ``state_dict()`` does, naming ``local_state_dict()``) or
        this rank's shard. ``fp32_states_only`` changes nothing: the state holds no fp16 copies here."""
        sd = self.state_dict() if gather_if_shard else self.local_state_dict()
        if not cast_to_cpu:
            return sd
        return torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, sd)

    def load_optimizer_backcompat(self, state_dict, gather_if_shard: bool = False):
        """Load what ``save_optimizer_backcompat`` returned (whole or this rank's shard: the state dict says which)."""
        self.load_state_dict(state_dict)


def _check_unique_params(optimizer) -> None:
    seen = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise SMPUsageError("the optimizer holds the same parameter twice (tied weights?): build it from "
                                    "model.parameters(), which lists each parameter once")
            seen.add(id(p))
