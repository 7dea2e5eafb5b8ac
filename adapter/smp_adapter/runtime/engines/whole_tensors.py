"""What only some engines change, with the defaults of an engine that holds whole tensors: the hooks of the
engine class before the job exists (its config, refusals, the process group), those of the job's instance
before any model exists (delayed initialisation's context, parameter placement and gathering), state-dict
merging, precision and optimizer internals, and checkpoints saved by another layout. ``Engine`` (base.py)
inherits these and adds the hooks every engine implements; an engine overrides here only what it does
differently (ZeRO-3 and MiCS shard parameters, the pipeline keeps a stage)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from smp_adapter.errors import SMPCheckpointError


class WholeTensorDefaults:
    # -- before the job exists: hooks of the class smp.init chose ----------------------------------
    @classmethod
    def build_job_config(cls, dims, backend: str | None):
        """The engine's one config for the job (smp.init puts it in the ``Job``: ``job.engine_config``), or None."""
        return None

    @classmethod
    def refuse_unsupported(cls, cfg) -> None:
        """smp.init, before the process group starts: raise UnsupportedFeatureError for what this engine
        cannot run on the installed libraries. Every rank raises at the same point, none inside a
        collective: a refusal after the process group started let a fast rank exit while a slow one was
        still connecting its groups, which died of "Connection reset by peer" instead of the refusal."""

    @classmethod
    def load_code(cls, dims) -> None:
        """smp.init, once the engine is chosen: import what the engine will run, so that its code
        (tens of MB of Python modules) is loaded before any model exists rather than mid-job."""

    @classmethod
    def start_process_group(cls, backend: str, rank: int, world_size: int, timeout, use_cuda: bool) -> None:
        import torch.distributed as dist

        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)

    @classmethod
    def forget_process_group(cls) -> None:
        """After the process group is destroyed (smp.shutdown): drop what the engine cached about it."""

    # -- before the model exists: hooks of the job's one instance ---------------------------------
    def module_init_context(self, dtype):
        """The context parameters are created in under delayed parameter initialisation: tensors
        without storage whose creation is recorded (runtime/deferred_init/), materialised when the
        engine knows what this rank keeps (``materialize_kept``)."""
        import weakref

        from smp_adapter.runtime.deferred_init import open_record

        record = open_record(self._deferred_init)
        self._deferred_init = weakref.ref(record)  # weak: the model's tensors keep it alive, nothing else
        return record.creating()

    def register_external_parameter(self, module, parameter) -> None:
        """``smp.register_parameter``: ``module`` uses ``parameter`` without owning it."""

    def is_own_parameter(self, param) -> bool:
        """Whether ``param`` is one of the engine's own shards (not a whole tensor)."""
        return False

    def local_data(self, tensor):
        """The values this rank holds of a parameter or buffer: the engine's shard where it shards it
        (without padding the engine adds to even out shards)."""
        return tensor

    def holds_shards(self, module) -> bool:
        return any(self.is_own_parameter(p) for p in module.parameters())

    def gathered(self, params, modifier_rank=None):
        """A context inside which the engine's shards among ``params`` hold their whole values
        (collective: every rank passes the same parameters). ``modifier_rank``: whose writes are kept."""
        return contextlib.nullcontext()

    def sync_initial_state(self, module) -> None:
        """Start every replica from the same weights, as smp's constructor did: every parameter and
        buffer from dp rank 0 over the DP group (which holds the TP group). Called before the
        tensor-parallel split, so each TP rank's shard is a slice of the same matrix although users
        seed with their dp rank (smp v1 docs: "the same random seed ... across ranks" is not required).
        Tensors created under delayed initialisation have no values yet: every rank of the DP group
        takes its first rank's recorded random states instead, so that replaying the creation gives
        every rank the first rank's values (one broadcast of a few KB per random tensor)."""
        from smp_adapter.runtime.deferred_init import DeferredTensor, module_tensors, record_of

        tensors = module_tensors(module)
        record = record_of(module)
        if record is not None:
            adopt_first_rank_random_states(record, self.job.groups.dp)
        broadcast_from_first_rank([t for t in tensors if not isinstance(t, DeferredTensor)], self.job.groups.dp,
                                  self.job.device)

    def place_module(self, module, device) -> None:
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

    def materialize_kept(self, module, device) -> None:
        """DistributedModel, after the tensor-parallel split: give storage to the tensors created
        under delayed initialisation that this rank keeps from now on, on its device (every one: a
        data-parallel or tensor-parallel rank keeps its whole split module). The pipeline engine
        keeps them until it knows the rank's stage."""
        from smp_adapter.runtime.deferred_init import materialize_in_place, module_tensors, record_of

        record = record_of(module)
        if record is not None:
            materialize_in_place(record, module_tensors(module), device)

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

    # -- optimizer and precision ----------------------------------------------------------------
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

    def step_timing(self) -> dict | None:
        """What the last step call's schedule timing was, for the communication ledger (the
        pipeline engine: this rank's compute and idle time); None when the engine has none."""
        return None

    # -- partial checkpoints saved by another layout (runtime/checkpoint/dirs.py) -----------------
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


def broadcast_from_first_rank(tensors, group, device) -> None:
    """Overwrite ``tensors`` on every member of ``group`` with its first member's (collective: every
    member passes the same tensors in the same order). Nothing to do alone or without a group.
    ``device``: the job's device (host tensors travel through it where NCCL needs device tensors)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    # NCCL sends device tensors only: a model the pipeline engine keeps on the host until it knows
    # the rank's stage goes through the device one tensor at a time
    via_device = dist.get_backend(group) == "nccl" and device is not None and device.type == "cuda"
    with torch.no_grad():
        for tensor in tensors:
            if via_device and tensor.device.type == "cpu":
                sent = tensor.data.to(device)
                dist.broadcast(sent, src=src, group=group)
                tensor.data.copy_(sent)
            else:
                dist.broadcast(tensor.data, src=src, group=group)
