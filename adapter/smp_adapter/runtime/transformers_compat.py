"""transformers' own SageMaker model-parallel path (``Trainer`` with smp enabled) on transformers 5.x.

smp v1 users ran unmodified Hugging Face ``Trainer`` scripts: with ``SM_HP_MP_PARAMETERS`` set,
transformers detects smp and drives it itself (``smp.init``, ``smp.DistributedModel`` in
``_wrap_model``, ``smp.DistributedOptimizer`` in ``create_optimizer``, ``@smp.step``). transformers
4.x created the optimizer after wrapping the model. transformers 5.x's ``_prepare_for_training``
still delays the creation on this path, but then, because the wrapped model is not ``self.model``,
takes the branch that only calls ``accelerator.prepare(self.optimizer)`` with no optimizer: the
optimizer is never created, and ``create_scheduler`` fails with ``'NoneType' object has no
attribute 'param_groups'`` inside ``LambdaLR`` (transformers 5.23, read 2026-11-23).

``restore_trainer_optimizer_creation`` puts the missing step back: ``Trainer.create_scheduler``
first calls ``Trainer.create_optimizer`` (which builds the configured optimizer over the model's
parameters and wraps it in ``smp.DistributedOptimizer``, as transformers 4.x did) when smp is
enabled and no optimizer exists yet. A Trainer that has its optimizer (any other path, a user's
``optimizers=``, a transformers release that fixes this) is untouched. It is installed when
``smp.DistributedModel`` is created while ``transformers.trainer`` is loaded: Trainer wraps the
model before it creates the scheduler.
"""

from __future__ import annotations

import functools
import sys

_MARK = "_smp_adapter_creates_missing_optimizer"


def restore_trainer_optimizer_creation() -> None:
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls.create_scheduler, _MARK, False):
        return
    original = trainer_cls.create_scheduler

    @functools.wraps(original)
    def create_scheduler(self, num_training_steps, optimizer=None):
        if optimizer is None and self.optimizer is None and trainer_module.is_sagemaker_mp_enabled():
            self.create_optimizer()
        return original(self, num_training_steps, optimizer)

    setattr(create_scheduler, _MARK, True)
    trainer_cls.create_scheduler = create_scheduler
