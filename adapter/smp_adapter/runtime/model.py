"""``smp.DistributedModel``: the smp surface over the job's engine.

The constructor prepares the module the same way for every layout (same initial weights on every
replica, smp's distributed-transformer names, the tensor-parallel split) and then hands it to the
engine the layout needs (runtime/engines: DeepSpeed at pp = 1, torch pipelining at pp > 1). Every
method below delegates execution to that engine and never asks which one it is.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.engines.base import model_dtype
from smp_adapter.runtime.state import require_initialized, state


class DistributedModel(nn.Module):
    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 trace_memory_usage: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1, average_grads_across_microbatches: bool = True,
                 bucket_cap_mb: float = 25, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False):
        s = require_initialized("DistributedModel")
        _refuse_bad_arguments(s, module, trace_device, backward_passes_per_step)
        super().__init__()
        self.module = module
        from smp_adapter.parallel.smp_layout import add_pre_1_10_module_alias

        add_pre_1_10_module_alias(module)  # smp < 1.10 scripts reach the model as model.module.module
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = average_grads_across_microbatches
        self.broadcast_buffers = broadcast_buffers
        # pp > 1 traces on the meta device whatever this says (no parameter memory; docs/pipeline.md)
        self.trace_device = trace_device
        self.partitioned = False
        self._post_partition_hooks: list = []
        self._post_step_hooks: list = []
        self._distributed_modules: list[str] = []
        engine = s.engine  # the job's one engine, created by smp.init from the layout
        if _created_for_tensor_parallelism(module):
            from smp_adapter.compat.hf_skipped_init import initialize_skipped_weights

            # the GPT templates skip transformers' init_weights, counting on smp's distributed modules to draw
            # the weights (compat/hf_skipped_init.py); before anything is placed, shared or sharded
            with _recording_if_delayed(module):
                initialize_skipped_weights(module)
        engine.place_module(module, s.device)
        # Every replica starts from dp rank 0's weights (users seed with dp_rank), before the
        # tensor-parallel split; the engine knows what it shards
        engine.sync_initial_state(module)
        if _created_for_tensor_parallelism(module):
            # smp v1's distributed-transformer names (transformer.seq_layers, .attention, .output),
            # which scripts walk for set_partition / set_activation_checkpointing
            from smp_adapter.parallel.smp_layout import add_smp_layout

            add_smp_layout(module)
        before = dict(module.named_modules())
        if s.dims.tp > 1:
            self._distributed_modules = _split_for_tensor_parallelism(module, engine, s)
        engine.materialize_kept(module, s.device)  # delayed init: what this rank keeps gets storage now
        from smp_adapter.runtime.kernel_switches import apply_at_wrap
        from smp_adapter.translate.kernels import compile_setting_from

        # flash_attention's SDPA switch; SMP_ADAPTER_COMPILE=blocks compiles each block before the engine shards it
        apply_at_wrap(module, s.dims, compile_setting_from(os.environ), s.rank)
        engine.attach_model(self, {n: before[n] for n in self._distributed_modules})
        #: the engine that executes this model (runtime/engines): the job's one engine, attached above
        self.runtime_engine = engine
        from smp_adapter.runtime.finiteness import StepGuard, check_initial_weights, policy_from_env

        check_initial_weights(module, engine.local_data)  # once: NaN/inf weights would train on NaN to exit status 0
        self._first_loss_checked = False
        #: the per-step finiteness check (runtime/finiteness.py), its policy from SMP_ADAPTER_NON_FINITE
        self.step_guard = StepGuard(policy_from_env(os.environ), loss_scaling=bool(s.cfg.fp16))
        s.model = self
        from smp_adapter.compat.hf_transformers import patch_trainer
        from smp_adapter.runtime.optimizer import DistributedOptimizer

        # a Hugging Face Trainer wrapping this model: what its smp path gets wrong
        patch_trainer(DistributedModel, DistributedOptimizer)

    # -- engine ----------------------------------------------------------------------------------
    @property
    def engine(self):
        """DeepSpeed's engine when the job runs on it (built on first use), else None (pipeline, MiCS):
        only the DeepSpeed engine class has ``deepspeed_engine``, the Engine base names no engine."""
        engine = self.runtime_engine
        # the class is asked, not the instance: an AttributeError while DeepSpeed's engine is built must surface
        return engine.deepspeed_engine if hasattr(type(engine), "deepspeed_engine") else None

    def mark_partitioned(self) -> None:
        """Called by the engine once the model has its final placement (runs post-partition hooks)."""
        if not self.partitioned:
            self.partitioned = True
            for hook in list(self._post_partition_hooks):
                hook(self, state.optimizer)

    def run_post_step_hooks(self, optimizer) -> None:
        """Called by DistributedOptimizer.step after each update."""
        for hook in list(self._post_step_hooks):
            hook(self, optimizer)

    # -- forward / backward ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        args, kwargs = _cast_floats((args, kwargs), model_dtype(state.cfg))
        return self.runtime_engine.forward(args, kwargs)

    def backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=None):
        if retain_graph or create_graph:
            raise SMPUsageError("DistributedModel.backward does not support retain_graph/create_graph (as smp v1)")
        loss = _scalar_loss(tensors, grad_tensors)
        if not self._first_loss_checked:  # once per job: no per-step cost
            from smp_adapter.runtime.finiteness import check_first_loss

            self._first_loss_checked = True
            check_first_loss(loss)
        self.step_guard.note_loss(loss)  # checked at optimizer.step(), with every rank's
        self.runtime_engine.backward(loss)

    # -- parameters ------------------------------------------------------------------------------
    def get_module(self) -> nn.Module:
        return self.module

    def virtual_named_parameters(self):
        """smp v1: every parameter of the model under its original name, on every rank (the fp16
        helpers of smp's examples map names to optimizer state with it)."""
        return self.module.named_parameters()

    def local_parameters(self):
        return (p for _, p in self.local_named_parameters())

    def local_named_parameters(self):
        return self.runtime_engine.local_named_parameters()

    def local_buffers(self):
        return (b for _, b in self.local_named_buffers())

    def local_named_buffers(self):
        return self.runtime_engine.local_named_buffers()

    def local_modules(self):
        return (m for _, m in self.local_named_modules())

    def local_named_modules(self):
        return self.runtime_engine.local_named_modules()

    def distributed_modules(self):
        return list(self._distributed_modules)

    def is_distributed_parameter(self, param) -> bool:
        return _is_split(param)

    def is_distributed_buffer(self, buf) -> bool:
        return False

    def is_scaled_batch_parameter(self, param) -> bool:
        return self.is_distributed_parameter(param)

    def is_scaled_batch_buffer(self, buf) -> bool:
        return False

    def default_reducer_named_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if not self.is_distributed_parameter(p)]

    def scaled_batch_reducer_named_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if self.is_distributed_parameter(p)]

    # -- hooks -------------------------------------------------------------------------------------
    def register_post_partition_hook(self, hook):
        return _Handle(self._post_partition_hooks, hook)

    def register_post_step_hook(self, hook):
        return _Handle(self._post_step_hooks, hook)

    def register_comm_hook(self, state, callable):  # noqa: A002  (the documented names, usable as keywords)
        from smp_adapter.errors import UnsupportedFeatureError

        raise UnsupportedFeatureError("register_comm_hook (DDP communication hooks) is not carried out on DeepSpeed "
                                      "engines: remove it; gradients are averaged over the data-parallel group")

    def join(self, *args, **kwargs):
        from smp_adapter.errors import UnsupportedFeatureError

        raise UnsupportedFeatureError("DistributedModel.join (uneven inputs) is not supported: give every "
                                      "data-parallel rank the same number of batches (DistributedSampler, drop_last=True)")

    # -- state dicts (see checkpoint.py) -----------------------------------------------------------
    def state_dict(self, *args, gather_to_rank0: bool = False, **kwargs):
        from smp_adapter.runtime.checkpoint.save_load import full_model_state_dict

        if args or kwargs:  # nn.Module internals (destination=..., prefix=...) during nesting
            return super().state_dict(*args, **kwargs)
        return full_model_state_dict(self, gather_to_rank0)

    def local_state_dict(self):
        from smp_adapter.runtime.checkpoint.save_load import local_model_state_dict

        return local_model_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, same_partition_load: bool = False):
        from smp_adapter.runtime.checkpoint.save_load import load_model_state_dict

        return load_model_state_dict(self, state_dict, strict=strict)

    def cpu(self):
        return self.state_dict()


def _refuse_bad_arguments(s, module, trace_device, backward_passes_per_step) -> None:
    """DistributedModel's arguments checked before anything is wrapped (``s``: the smp state)."""
    if isinstance(module, DistributedModel):
        raise SMPUsageError("this model is already an smp.DistributedModel: wrap the plain nn.Module once")
    if not isinstance(module, nn.Module):
        raise SMPUsageError(f"smp.DistributedModel wraps a torch.nn.Module, got {type(module).__name__}")
    if s.model is not None:
        raise SMPUsageError("only one smp.DistributedModel per script (smp v1 rule): reuse the existing one, "
                            "or wrap a module that holds all your models")
    if trace_device not in ("cpu", "gpu"):
        raise SMPUsageError(f"trace_device must be 'cpu' or 'gpu', got {trace_device!r}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise SMPUsageError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")


def _split_for_tensor_parallelism(module, engine, s) -> list[str]:
    """tp > 1: split the marked modules (reading sharded weights inside the engine's ``gathered``
    block); return their qualified names, and say so when nothing was marked (``s``: the smp state)."""
    with _recording_if_delayed(module):  # the split of a delayed model is replayed with its creation
        split = _apply_tensor_parallelism(module, engine.gathered)
    if not split and s.rank == 0:
        warnings.warn(
            f"tensor_parallel_degree is {s.dims.tp} but nothing in {type(module).__name__} was split: no module "
            "was marked for tensor parallelism, so every tensor-parallel rank holds the whole model and "
            "trains it as a data-parallel replica. Mark the model: create it inside "
            "smp.tensor_parallelism() or smp.model_creation(tensor_parallelism=True), or call "
            "smp.set_tensor_parallelism(module, True) on its layers before smp.DistributedModel "
            "(transformers' Trainer creates no module under those: create the model so before "
            "giving it to Trainer)")
    return split


class _Handle:
    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook
        hooks.append(hook)

    def remove(self):
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def _scalar_loss(tensors, grad_tensors):
    if grad_tensors is not None:
        # backward(outputs, out_grads): the scalar sum(t * g) has exactly these gradients
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
        tensors = sum((t * g.detach()).sum() for t, g in zip(tensors, grads))
    elif isinstance(tensors, (list, tuple)):
        tensors = sum(t.sum() if t.dim() else t for t in tensors)
    if tensors.dim() != 0:
        raise SMPUsageError(f"model.backward needs a scalar loss, got a tensor of shape {tuple(tensors.shape)}: "
                            "reduce it (e.g. loss.mean()) or pass grad_tensors")
    return tensors


def _recording_if_delayed(module):
    import contextlib

    from smp_adapter.runtime.deferred_init import record_of

    record = record_of(module)
    return record.creating() if record is not None else contextlib.nullcontext()


def _apply_tensor_parallelism(module, gathered):
    from smp_adapter.parallel.tensor import apply_tensor_parallelism, current_tp_context

    return apply_tensor_parallelism(module, current_tp_context(), gathered=gathered)


def _is_split(param) -> bool:
    """Whether a parameter is a tensor-parallel shard (reduced over RDP, not DP)."""
    if state.dims is None or state.dims.tp == 1:
        return False
    from smp_adapter.parallel.tensor import is_distributed_parameter

    return is_distributed_parameter(param)


def _created_for_tensor_parallelism(module) -> bool:
    """Created inside model_creation(tensor_parallelism=True) / tensor_parallelism(), or marked
    with set_tensor_parallelism (at any tensor-parallel degree, 1 included)."""
    from smp_adapter.parallel.marking import get_mark

    mark = get_mark(module)
    return mark is not None and mark.enabled


def _cast_floats(obj, dtype):
    """fp16/bf16 jobs: floating inputs follow the model's dtype, as smp's FP16 module wrapper did."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
