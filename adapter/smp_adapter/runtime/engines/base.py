"""The interface every engine carries out for ``DistributedModel``, ``DistributedOptimizer``,
``@smp.step`` and the checkpoint code (docs/architecture.md).

An engine owns *how* a wrapped model is executed; the smp objects own *what* the user asked for.
The smp objects call only these methods and never ask which engine they hold. One engine per
job, chosen from the layout when smp.init runs (``ParallelDims.engine``, ``engines.job_engine``).

Lifecycle, as Lightning Fabric's strategies: before any model exists the chosen *class* starts the
process group (``start_process_group``) and gives the module-init context of delayed initialisation
(``module_init_context``, ``register_external_parameter``); ``DistributedModel`` asks it to place the
module (``place_module``) and to gather parameters it shards (``gathered``, ``holds_shards``), then
creates the instance after tensor-parallel splitting; ``attach_optimizer`` when
``DistributedOptimizer`` is created; then per step ``run_step`` (microbatches), ``forward`` /
``backward`` from inside or outside the step function, ``optimizer_step``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from smp_adapter.errors import SMPCheckpointError, UnsupportedFeatureError


class Engine(ABC):
    #: registry name (``engines.ENGINES``)
    name: str = ""

    # -- before the model exists: hooks of the class smp.init chose ---------------------------------
    @classmethod
    def build_job_config(cls, dims, backend: str | None):
        """The engine's one config for the job (smp.init keeps it in ``state.engine_config``), or None."""
        return None

    @classmethod
    def load_code(cls) -> None:
        """smp.init, once the engine is chosen: import what the engine will run, so that its code
        (tens of MB of Python modules) is loaded before any model exists rather than mid-job."""

    @classmethod
    def start_process_group(cls, backend: str, rank: int, world_size: int, timeout, use_cuda: bool) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)

    @classmethod
    def forget_process_group(cls) -> None:
        """After the process group is destroyed (smp.shutdown): drop what the engine cached about it."""

    @classmethod
    def module_init_context(cls, dtype):
        """The context parameters are created in under delayed parameter initialisation: tensors
        without storage whose creation is recorded (runtime/deferred_init/), materialised when the
        engine knows what this rank keeps (``materialize_kept``)."""
        import weakref

        from smp_adapter.runtime.deferred_init import open_record
        from smp_adapter.runtime.state import state

        record = open_record(state.deferred_init)
        state.deferred_init = weakref.ref(record)  # weak: the model's tensors keep it alive, nothing else
        return record.creating()

    @classmethod
    def register_external_parameter(cls, module, parameter) -> None:
        """``smp.register_parameter``: ``module`` uses ``parameter`` without owning it."""

    @classmethod
    def is_own_parameter(cls, param) -> bool:
        """Whether ``param`` is one of the engine's own shards (not a whole tensor)."""
        return False

    @classmethod
    def local_data(cls, tensor):
        """The values this rank holds of a parameter or buffer: the engine's shard where it shards it
        (without padding the engine adds to even out shards)."""
        return tensor

    @classmethod
    def holds_shards(cls, module) -> bool:
        return any(cls.is_own_parameter(p) for p in module.parameters())

    @classmethod
    def gathered(cls, params, modifier_rank=None):
        """A context inside which the engine's shards among ``params`` hold their whole values
        (collective: every rank passes the same parameters). ``modifier_rank``: whose writes are kept."""
        return contextlib.nullcontext()

    @classmethod
    def sync_initial_state(cls, module) -> None:
        """Start every replica from the same weights, as smp's constructor did: every parameter and
        buffer from dp rank 0 over the DP group (which holds the TP group). Called before the
        tensor-parallel split, so each TP rank's shard is a slice of the same matrix although users
        seed with their dp rank (smp v1 docs: "the same random seed ... across ranks" is not required).
        Tensors created under delayed initialisation have no values yet: every rank of the DP group
        takes its first rank's recorded random states instead, so that replaying the creation gives
        every rank the first rank's values (one broadcast of a few KB per random tensor)."""
        from smp_adapter.runtime.deferred_init import DeferredTensor, module_tensors, record_of
        from smp_adapter.runtime.state import state

        tensors = module_tensors(module)
        record = record_of(module)
        if record is not None:
            adopt_first_rank_random_states(record, state.groups.dp)
        broadcast_from_first_rank([t for t in tensors if not isinstance(t, DeferredTensor)], state.groups.dp)

    @classmethod
    def place_module(cls, module, device) -> None:
        """DistributedModel: put a freshly created module where the engine wants it before the
        tensor-parallel split (whole tensors on the job's device). Tensors created under delayed
        initialisation stay without storage until ``materialize_kept``."""
        from smp_adapter.runtime.deferred_init import holds_deferred

        if not holds_deferred(module):
            module.to(device)
            return
        for m in module.modules():  # the real ones (literals such as BatchNorm's counter) move now
            for name, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None and not _deferred(t) and t.device != torch.device(device):
                    from smp_adapter.runtime.deferred_init import replace_in_place

                    replace_in_place(t, t.detach().to(device))

    @classmethod
    def materialize_kept(cls, module, device) -> None:
        """DistributedModel, after the tensor-parallel split: give storage to the tensors created
        under delayed initialisation that this rank keeps from now on, on its device (every one: a
        data-parallel or tensor-parallel rank keeps its whole split module). The pipeline engine
        keeps them until it knows the rank's stage."""
        from smp_adapter.runtime.deferred_init import materialize_in_place, module_tensors, record_of

        record = record_of(module)
        if record is not None:
            materialize_in_place(record, module_tensors(module), device)

    def __init__(self, model, tp_originals: dict):
        """``model``: the DistributedModel (public members only); ``tp_originals``: qualified name ->
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

    # -- model state dicts (runtime/checkpoint/save_load.py builds them; the engine adds its part) ---------
    def merge_full_state_dict(self, sd: dict) -> dict:
        """A full-layout state dict of this rank's entries -> the whole model's (collective)."""
        return sd

    def local_state_dict(self, sd: dict) -> dict:
        """This rank's part of a full-layout state dict (and the engine's marks)."""
        return sd

    def local_tensors(self) -> dict:
        """Copies of this rank's tensors of the module, by name (before ``local_state_dict``)."""
        return {k: v.detach().clone().cpu() for k, v in self.model.module.state_dict().items()}

    def load_whole_state_dict(self, sd: dict, strict: bool):
        """Load a state dict of whole tensors (tensor-parallel slices already taken) into the module.
        ZeRO-3: rank 0's writes into the gathered values are re-partitioned on exit."""
        module = self.model.module
        with self.gathered(list(module.parameters()), modifier_rank=0):
            return module.load_state_dict(sd, strict=strict)

    def load_local_state_dict(self, sd: dict, strict: bool):
        """Load a partial state dict (layout already checked): every entry is this rank's."""
        return self.model.module.load_state_dict(sd, strict=strict)

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

    @property
    def skips_non_finite_steps(self) -> str | None:
        """How a step with a non-finite loss is skipped: "drop" (zero the gradients, no update), "engine"
        (the engine sees the NaN gradients and skips the update itself), None (it cannot be skipped)."""
        return "drop"

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped because fp16 gradients overflowed."""
        return False

    @property
    def loss_scale(self) -> float:
        return 1.0

    @property
    def mixed_precision(self):
        """The engine's own fp16/bf16 master-weight keeper, if it has one (None otherwise)."""
        return None

    @property
    def optimizer_internals(self):
        """The engine's optimizer wrapper that scripts may read attributes of (DeepSpeed's ZeRO
        optimizer), or None."""
        return None

    def param_shard_group(self):
        """The process group ZeRO-3 parameter shards are spread over; AttributeError without one."""
        raise AttributeError("ds_param_shard_group exists only with sharded_data_parallel_degree > 1 (ZeRO-3 "
                             "parameter shards); without it every rank holds whole parameters")

    @abstractmethod
    def optimizer_state_dict(self, optimizer) -> dict:
        ...

    @abstractmethod
    def optimizer_local_state_dict(self, optimizer) -> dict:
        ...

    @abstractmethod
    def load_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        ...

    def step_timing(self) -> dict | None:
        """What the last step call's schedule timing was, for the communication ledger (the
        pipeline engine: this rank's compute and idle time); None when the engine has none."""
        return None

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

    def load_partial_from_other_layout(self, folder, optimizer, manifest: dict, difference: str) -> None:
        """Load a partial checkpoint saved by another layout (``difference`` says how it differs)
        from its layout-independent pieces (runtime/checkpoint/universal.py)."""
        from smp_adapter.runtime.checkpoint import universal

        if "universal" not in manifest:
            raise SMPCheckpointError(
                f"checkpoint {folder} was saved with another parallel layout ({difference}) and without "
                f"layout-independent pieces ({universal.ENV_SWITCH}=0, or an older smp-adapter): resume "
                f"it with the saved layout ({manifest.get('layout')}), then save again without that setting")
        self.load_universal(Path(folder), manifest["universal"])

    def load_universal(self, folder: Path, universal: dict) -> None:
        """Put the model, optimizer state and loss scaler back from the universal pieces."""
        raise SMPCheckpointError(
            f"checkpoint {folder} was saved with another parallel layout and this job's engine "
            f"({type(self).__name__}) cannot re-shard it: resume with the saved layout, or load a full checkpoint "
            "(partial=False)")


def model_dtype(cfg):
    """The dtype fp16/bf16 jobs hold the model in (None: as created)."""
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def refuse_full_sharded_optimizer_state():
    raise UnsupportedFeatureError(
        "a full optimizer state_dict is not available with optimizer-state sharding (as in smp v1): use "
        "optimizer.local_state_dict() or smp.save_checkpoint(..., partial=True)")


def _deferred(tensor) -> bool:
    from smp_adapter.runtime.deferred_init import DeferredTensor

    return isinstance(tensor, DeferredTensor)


def adopt_first_rank_random_states(record, group) -> None:
    """Every member of ``group`` takes its first member's recorded random states (collective)."""
    import torch.distributed as dist

    if record is None or group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    payload = [record.random_states()]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    record.adopt_random_states(payload[0])


def broadcast_from_first_rank(tensors, group) -> None:
    """Overwrite ``tensors`` on every member of ``group`` with its first member's (collective: every
    member passes the same tensors in the same order). Nothing to do alone or without a group."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    from smp_adapter.runtime.state import state

    # NCCL sends device tensors only: a model the pipeline engine keeps on the host until it knows
    # the rank's stage goes through the device one tensor at a time
    via_device = dist.get_backend(group) == "nccl" and state.device is not None and state.device.type == "cuda"
    with torch.no_grad():
        for tensor in tensors:
            if via_device and tensor.device.type == "cpu":
                sent = tensor.data.to(state.device)
                dist.broadcast(sent, src=src, group=group)
                tensor.data.copy_(sent)
            else:
                dist.broadcast(tensor.data, src=src, group=group)
