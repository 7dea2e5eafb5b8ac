"""The interface every engine carries out for ``DistributedModel``, ``DistributedOptimizer``,
``@smp.step`` and the checkpoint code (docs/architecture.md).

An engine owns *how* a wrapped model is executed; the smp objects own *what* the user asked for.
The smp objects call only these methods and never ask which engine they hold. One engine per
job, chosen from the layout when smp.init runs (``ParallelDims.engine``, ``engines.engine_for``).

Lifecycle, as Lightning Fabric's strategies: before the job exists the chosen *class* refuses what
it cannot run and starts the process group (``start_process_group``) and builds its config; smp.init
then creates the job's one *instance* from the job (runtime/job.py ``Job``), the live step
progress (runtime/state.py ``StepProgress``) and ``warn_once``: an engine reads nothing else of the
process. Before any model exists that instance gives the module-init context of delayed initialisation
(``module_init_context``, ``register_external_parameter``); ``DistributedModel`` asks it to place
the module (``place_module``) and to gather parameters it shards (``gathered``, ``holds_shards``),
then attaches the model after tensor-parallel splitting (``attach_model``); ``attach_optimizer``
when ``DistributedOptimizer`` is created; then per step ``run_step`` (microbatches), ``forward`` /
``backward`` from inside or outside the step function, ``optimizer_step``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from smp_adapter.errors import UnsupportedFeatureError
from smp_adapter.runtime.engines.whole_tensors import WholeTensorDefaults


class Engine(WholeTensorDefaults, ABC):
    """The hooks every engine implements (abstract here); what only some engines change, with its
    whole-tensor defaults, is inherited from ``WholeTensorDefaults`` (whole_tensors.py)."""

    #: registry name (``engines.ENGINES``)
    name: str = ""

    def __init__(self, job, progress, warn_once):
        """``job``: the frozen job description (runtime/job.py); ``progress``: the live ``StepProgress``
        (in_step, microbatch, step_calls), written by ``@smp.step``; ``warn_once(messages, rank)``: the
        job's once-per-job warning (runtime/state.py), handed in as the engine imports no process state."""
        self.job = job
        self.progress = progress
        self.warn_once = warn_once
        self.model = None  # the DistributedModel, once attached
        self._deferred_init = None  # weak reference to the live record of delayed initialisation

    def attach_model(self, model, tp_originals: dict) -> None:
        """DistributedModel, once its module is placed and split: drive ``model`` from now on.
        ``model``: the DistributedModel (public members only); ``tp_originals``: qualified name ->
        module as it was before the tensor-parallel split (pipeline tracing needs them)."""
        self.model = model

    # -- model -----------------------------------------------------------------------------------
    @abstractmethod
    def run_step(self, func, bound_mbs: list, detach: bool) -> list:
        """Run the step body once per microbatch (``bound_mbs``: its bound arguments, one per
        microbatch); return the body's return values, one per microbatch."""

    @abstractmethod
    def forward(self, args: tuple, kwargs: dict):
        """``model(*args, **kwargs)``, inside a step function or outside (plain style)."""

    @abstractmethod
    def backward(self, loss) -> None:
        """``model.backward(loss)`` with a scalar loss."""

    @abstractmethod
    def local_named_parameters(self):
        ...

    @abstractmethod
    def local_named_buffers(self):
        ...

    @abstractmethod
    def local_named_modules(self):
        ...

    # -- optimizer -------------------------------------------------------------------------------
    @abstractmethod
    def attach_optimizer(self, optimizer, loss_scale) -> None:
        """``smp.DistributedOptimizer(optimizer, ...)`` was created (``loss_scale``: LossScaleArgs)."""

    @property
    @abstractmethod
    def ready_for_checkpoint(self) -> bool:
        """Whether the optimizer side exists, as partial checkpoints need."""

    @abstractmethod
    def optimizer_step(self, optimizer, clip_norm: float | None) -> None:
        """Reduce what is still unreduced, clip (``clip_norm``), update."""

    @abstractmethod
    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        ...

    @abstractmethod
    def optimizer_state_dict(self, optimizer) -> dict:
        ...

    @abstractmethod
    def optimizer_local_state_dict(self, optimizer) -> dict:
        ...

    @abstractmethod
    def load_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        ...

    # -- partial checkpoints (runtime/checkpoint/dirs.py) ----------------------------------------
    @abstractmethod
    def save_partial(self, io, optimizer) -> dict:
        """Write this rank's model and optimizer state into ``io.folder`` (the staging directory),
        every file through ``io`` (runtime/checkpoint/io.py ``CheckpointIO``: written with
        ``io.torch_save``, or noted with ``io.note``); return what the manifest should record about it
        (rank 0's return value is kept)."""

    @abstractmethod
    def load_partial(self, io, optimizer, strict: bool, load_optimizer: bool) -> None:
        """Load a partial checkpoint saved by this same layout from ``io.folder``, reading every file
        through ``io`` (``io.torch_load``, or ``io.source``), which hashes it for the resume's check."""


def model_dtype(cfg):
    """The dtype fp16/bf16 jobs hold the model in (None: as created)."""
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def refuse_full_sharded_optimizer_state():
    raise UnsupportedFeatureError(
        "a full optimizer state_dict is not available with optimizer-state sharding (as in smp v1): use "
        "optimizer.local_state_dict() or smp.save_checkpoint(..., partial=True)")
