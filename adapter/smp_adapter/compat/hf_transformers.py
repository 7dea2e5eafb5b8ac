"""transformers' own SageMaker model-parallel path (``Trainer`` with smp enabled), on every transformers of
the supported range.

smp v1 users ran unmodified Hugging Face ``Trainer`` scripts: with ``SM_HP_MP_PARAMETERS`` holding
``partitions`` (smp-adapter launch always puts it there) and ``sagemaker_mpi_enabled`` in
``SM_FRAMEWORK_PARAMS``, transformers detects smp and drives it itself (``smp.init``,
``smp.DistributedModel`` in ``_wrap_model``, ``smp.DistributedOptimizer`` in ``create_optimizer``,
``@smp.step``, ``smp_gather`` in evaluation). That path rotted upstream; ``patch_trainer`` puts back
what each range gets wrong, one shim each, and leaves everything else as transformers wrote it.
It runs when ``smp.DistributedModel`` is created while ``transformers.trainer`` is loaded (Trainer
wraps the model before it creates the optimizer and before any evaluation or save).

* transformers 5.x (read at 5.23 and 5.24): ``_prepare_for_training`` delays the optimizer's creation
  on this path, then, because the wrapped model is not ``self.model``, takes the branch that only
  calls ``accelerator.prepare(self.optimizer)`` with no optimizer: it is never created, and
  ``create_scheduler`` fails with ``'NoneType' object has no attribute 'param_groups'`` inside
  ``LambdaLR``. Shim: ``create_scheduler`` first calls ``create_optimizer`` (which builds the
  configured optimizer and wraps it in ``smp.DistributedOptimizer``, as 4.x did) when smp is enabled
  and no optimizer exists yet.
* transformers 5.x (5.24): ``evaluate`` / ``predict`` call ``_wrap_model(self.model)``, whose test for
  "already wrapped" looks at its argument (the plain model), not at ``self.model_wrapped`` as 4.x did,
  and wrap the model in a second ``smp.DistributedModel`` (smp forbids it: "only one
  smp.DistributedModel per script"). Shim: ``_wrap_model`` returns the existing DistributedModel
  when given the model it wraps.
* a release whose Trainer wraps smp's optimizer in accelerate's ``AcceleratedOptimizer`` on this path
  (4.57, CI's transformers-4.57 point; 5.24 does not wrap it, and 4.38 with accelerate >= 1.0 cannot start a
  Trainer at all, smp or not: ``Accelerator(dispatch_batches=...)``): ``_save_optimizer_and_scheduler`` then calls
  ``self.optimizer.local_state_dict(gather_if_shard=False)``, an ``smp.DistributedOptimizer`` method,
  on accelerate's wrapper: ``'AcceleratedOptimizer' object has no attribute 'local_state_dict'`` at
  every checkpoint save (the end of training among them). Shim: ``AcceleratedOptimizer`` gets
  ``local_state_dict``, answered by the optimizer it wraps when that is smp's.
* the same releases (4.57 with accelerate 1.15): ``AcceleratedOptimizer.__init__`` moves the optimizer's
  state to accelerate's device through a full ``state_dict()`` / ``load_state_dict()`` round trip. Under
  optimizer-state sharding (tp or sdp with ``ddp``) a full optimizer state_dict is refused, as in smp v1,
  and the Trainer dies before its first step; without sharding the round trip would only copy state smp
  already placed. Shim: accelerate's wrapper of an ``smp.DistributedOptimizer`` is made with
  ``device_placement=False`` (smp's engines place the optimizer state on the rank's device themselves).
"""

from __future__ import annotations

import functools
import sys

_MARK = "_smp_adapter_creates_missing_optimizer"


def patch_trainer(model_cls: type, optimizer_cls: type) -> None:
    """``model_cls``, ``optimizer_cls``: smp's DistributedModel and DistributedOptimizer, handed in by the
    runtime so that this module imports nothing of it (the runtime imports this one)."""
    restore_trainer_optimizer_creation()
    wrap_model_once(model_cls)
    local_state_dict_through_accelerate(optimizer_cls)
    no_device_placement_round_trip(optimizer_cls)


def _patch_trainer(name: str, make) -> None:
    """Replace ``transformers.trainer.Trainer.<name>`` once by ``make(original, trainer_module)`` (when
    transformers' Trainer is imported; a second call finds the mark and does nothing)."""
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if trainer_cls is None or getattr(getattr(trainer_cls, name), _MARK, False):
        return
    original = getattr(trainer_cls, name)
    patched = functools.wraps(original)(make(original, trainer_module))
    setattr(patched, _MARK, True)
    setattr(trainer_cls, name, patched)


def restore_trainer_optimizer_creation() -> None:
    def make(original, trainer_module):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if optimizer is None and self.optimizer is None and trainer_module.is_sagemaker_mp_enabled():
                self.create_optimizer()
            return original(self, num_training_steps, optimizer)

        return create_scheduler

    _patch_trainer("create_scheduler", make)


def wrap_model_once(model_cls: type) -> None:
    def make(original, trainer_module):
        def _wrap_model(self, model, *args, **kwargs):
            wrapped = self.model_wrapped
            if (isinstance(wrapped, model_cls) and model is wrapped.module
                    and trainer_module.is_sagemaker_mp_enabled()):
                return wrapped
            return original(self, model, *args, **kwargs)

        return _wrap_model

    _patch_trainer("_wrap_model", make)


def local_state_dict_through_accelerate(optimizer_cls: type) -> None:
    accelerate_optimizer = sys.modules.get("accelerate.optimizer")
    wrapper_cls = getattr(accelerate_optimizer, "AcceleratedOptimizer", None)
    if wrapper_cls is None or hasattr(wrapper_cls, "local_state_dict"):
        return

    def local_state_dict(self, *args, **kwargs):
        if not isinstance(self.optimizer, optimizer_cls):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'local_state_dict' (it wraps "
                                 f"{type(self.optimizer).__name__}, not smp.DistributedOptimizer)")
        return self.optimizer.local_state_dict(*args, **kwargs)

    wrapper_cls.local_state_dict = local_state_dict


def no_device_placement_round_trip(optimizer_cls: type) -> None:
    accelerate_optimizer = sys.modules.get("accelerate.optimizer")
    wrapper_cls = getattr(accelerate_optimizer, "AcceleratedOptimizer", None)
    if wrapper_cls is None or getattr(wrapper_cls.__init__, _MARK, False):
        return
    original = wrapper_cls.__init__

    @functools.wraps(original)
    def __init__(self, optimizer, *args, **kwargs):
        if isinstance(optimizer, optimizer_cls):
            args, kwargs = (), {**kwargs, "device_placement": False,
                                **({"scaler": args[1]} if len(args) > 1 else {})}
        original(self, optimizer, *args, **kwargs)

    setattr(__init__, _MARK, True)
    wrapper_cls.__init__ = __init__
