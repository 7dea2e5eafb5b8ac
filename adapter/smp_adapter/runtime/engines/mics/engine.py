"""The MiCS engine: ``1 < sharded_data_parallel_degree < rdp`` at pipeline_parallel_degree 1, as smp
v1 documents it ("SDP is AWS's MiCS implementation"), on torch FSDP2 (``fully_shard``).

* Parameters, gradients and optimizer state are sharded inside each group of ``sdp`` ranks (1/sdp
  of each per rank); the groups are replicas (mesh.py: a 2-D DeviceMesh (replicate, shard) per TP rank).
* Each sharding unit (mesh.sharding_units: a transformer layer, or a wide one's projections) is
  all-gathered inside the group for its forward and again for its backward, then freed; its gradients
  are reduce-scattered inside the group after every microbatch and accumulate as shards.
* Across groups, each rank's gradient shard is all-reduced once per optimizer step: after the last
  microbatch of every ``backward_passes_per_step``-th step call (FSDP2's
  ``set_requires_all_reduce(False)`` before that), as MiCS did.
* Averaging: FSDP2 reduces with ReduceOp.AVG where it can; gloo sums instead (pytorch#162338), so
  every unit reduces with sums and FSDP2 divides by the data-parallel size afterwards
  (``set_force_sum_reduction_for_comms``): the same average on every backend.
* Microbatches: each microbatch's loss is divided by microbatches x backward_passes_per_step (smp's
  average over microbatches), as the DeepSpeed engine does.
* bf16 and fp16: FSDP2's mixed precision, compute and gathers in the job's dtype, fp32 shards (the
  optimizer's masters) and fp32 gradient reduction; fp16 adds smp's static or dynamic loss scaling
  (loss_scaling.py: overflowing steps skipped on every rank, as on ZeRO-3).
* Tensor parallelism: the mesh spans this TP rank's RDP group; without ``prescaled_batch`` each TP
  rank trains on its own samples, so the shards of replicated parameters are averaged over the TP
  group too before the update (the same shard on every TP rank: the parameters have equal shapes).
* Gradient clipping (``sdp_gradient_clipping``, ``clip_master_grads``) inside ``optimizer.step()``
  by the global norm of the whole model, from the shards (runtime/clipping.py); a script's (or the
  Trainer's) ``torch.nn.utils.clip_grad_norm_(model.parameters(), n)`` is routed to the same rule.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.engines.base import Engine, model_dtype
from smp_adapter.runtime.engines.mics import shards


class MicsEngine(Engine):
    name = "mics"

    def materialize_kept(self, module, device) -> None:
        """Nothing yet: the engine fills its shards tensor by tensor as it shards the model (creation.py)."""

    def sync_initial_state(self, module) -> None:
        """Without tensor parallelism the parameters are made equal as the engine shards them, tensor by
        tensor (creation.py: a broadcast only for what no rank can replay or read from the same file), so
        no rank holds a whole model's copy; the random states and the buffers now. Tensor parallelism splits
        whole tensors before the engine exists: those are made equal first, as every engine does."""
        job = self.job
        if job.dims.tp > 1:
            return super().sync_initial_state(module)
        from smp_adapter.runtime.deferred_init import DeferredTensor, module_tensors, record_of
        from smp_adapter.runtime.engines.whole_tensors import adopt_first_rank_random_states, broadcast_from_first_rank

        adopt_first_rank_random_states(record_of(module), job.groups.dp)
        parameters = {id(p) for p in module.parameters()}
        broadcast_from_first_rank([t for t in module_tensors(module)
                                   if id(t) not in parameters and not isinstance(t, DeferredTensor)], job.groups.dp,
                                  job.device)

    @classmethod
    def forget_process_group(cls) -> None:
        from smp_adapter.runtime.engines.deepspeed.process_group import forget_cached_groups

        forget_cached_groups()  # fp16 jobs joined DeepSpeed's communication layer (loss_scaling.py)

    @classmethod
    def load_code(cls, dims) -> None:
        import torch.distributed.fsdp  # noqa: F401  (fully_shard, and DTensor under it)

    def is_own_parameter(self, param) -> bool:
        return shards.is_shard(param)

    def local_data(self, tensor):
        return tensor.to_local() if shards.is_shard(tensor) else tensor

    def gathered(self, params, modifier_rank=None):
        return shards.gathered(params, self.model.module if self.model is not None else None, modifier_rank)

    def attach_model(self, model, tp_originals: dict) -> None:
        super().attach_model(model, tp_originals)
        job = self.job
        cfg, dims, groups = job.cfg, job.dims, job.groups
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from smp_adapter.runtime.engines.mics.mesh import mics_mesh
        from smp_adapter.runtime.engines.mics.units import sharding_units
        from smp_adapter.translate.mics import RESHARD_AFTER_FORWARD

        mesh = mics_mesh(dims, job.rank, groups.sdp, groups.sdp_replicas, job.device.type)
        dtype = model_dtype(cfg)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        module = model.module
        self.units = sharding_units(module, dims.sdp) + [module]

        def shard(unit):
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=RESHARD_AFTER_FORWARD)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no AVG: sums, then one divide (pytorch#162338)

        from smp_adapter.runtime.engines.mics.creation import shard_units

        # each shard filled tensor by tensor (creation.py); the shards (the optimizer's masters) stay fp32 in a
        # bf16/fp16 job, which computes in its dtype; replicas start from the DP group's first rank unless the
        # whole tensors were made equal before the tensor-parallel split (sync_initial_state)
        shard_units(module, self.units, shard, mesh=mesh, master_fp32=dtype is not None, device=job.device,
                    group=groups.dp if dims.tp == 1 else None)
        from smp_adapter.runtime.engines.mics.zero_names import name_shards

        name_shards(module)  # the ZeRO-3 names scripts read (p.ds_tensor, p.ds_shape)
        self._optimizer = None
        self._scaler = None  # fp16: the loss scaler (loss_scaling.py), made with the optimizer
        self.last_grad_norm = 0.0  # the global gradient norm of the last optimizer step, before clipping
        # without prescaled_batch each TP rank had its own samples: replicated parameters also
        # average over the TP group (as runtime/engines/deepspeed does)
        self._tp_average = dims.tp > 1 and not cfg.prescaled_batch
        self._tp_averaged = False  # this step's replicated shards already averaged (by a clip before the step)
        model.mark_partitioned()
        from smp_adapter.runtime.clipping import route_torch_clipping

        # torch's own clip of the DTensor gradients sums over the mesh (one TP rank's sharding group) only:
        # a TP-split weight's shards would be left out of the norm
        route_torch_clipping(self)

    # -- model -----------------------------------------------------------------------------------
    def run_step(self, func, bound_mbs: list, detach: bool) -> list:
        from smp_adapter.runtime.step import run_microbatches

        return run_microbatches(func, bound_mbs, before_each=self._before_microbatch)

    def _before_microbatch(self, mb: int, num_microbatches: int) -> None:
        """The all-reduce across groups only after the last microbatch of every
        backward_passes_per_step-th step call; reduce-scatters inside the group every microbatch."""
        last_call = (self.progress.step_calls + 1) % self.model.backward_passes_per_step == 0
        self.model.module.set_requires_all_reduce(last_call and mb == num_microbatches - 1, recurse=True)

    def forward(self, args, kwargs):
        if not self.progress.in_step and torch.is_grad_enabled() and self.model.training:
            self.model.module.set_requires_all_reduce(True, recurse=True)  # plain style: reduced by its backward
        return self.model.module(*args, **kwargs)

    def backward(self, loss) -> None:
        if self._optimizer is None:
            raise SMPUsageError(
                "model.backward() needs an optimizer: wrap it with smp.DistributedOptimizer(optimizer) right after "
                "smp.DistributedModel, before the first step")
        if self.progress.in_step and self.model.average_grads_across_microbatches:
            loss = loss / (self.job.cfg.microbatches * self.model.backward_passes_per_step)
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        loss.backward()

    def local_named_parameters(self):
        return self.model.module.named_parameters()

    def local_named_buffers(self):
        return self.model.module.named_buffers()

    def local_named_modules(self):
        return self.model.module.named_modules()

    # -- model state dicts: this rank's shards --------------------------------------------------
    def local_tensors(self) -> dict:
        return {k: (v.to_local() if shards.is_shard(v) else v).detach().clone().cpu()
                for k, v in self.model.module.state_dict().items()}

    def load_local_state_dict(self, sd: dict, strict: bool):
        return shards.load_local(self.model.module, sd, strict)

    def load_whole_state_dict(self, sd: dict, strict: bool):
        from smp_adapter.runtime.engines.mics.zero_names import name_shards

        result = shards.load_whole(self.model.module, sd, strict)
        name_shards(self.model.module)  # FSDP2's load hook may have given a parameter a new local shard
        return result

    # -- optimizer -------------------------------------------------------------------------------
    def attach_optimizer(self, optimizer, loss_scale) -> None:
        owned = {id(p) for p in self.model.module.parameters()}
        stray = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
        if stray:
            raise SMPUsageError(
                f"the optimizer holds {len(stray)} tensor(s) that are not the wrapped model's parameters: with "
                "sharded_data_parallel_degree < rdp the model's parameters become shards when smp.DistributedModel "
                "wraps it; create the optimizer from model.parameters() after smp.DistributedModel")
        self._optimizer = optimizer
        if self.job.cfg.fp16:
            from smp_adapter.runtime.engines.mics.loss_scaling import ShardLossScaler

            self._scaler = ShardLossScaler(loss_scale, self.job.device)

    @property
    def overflow(self) -> bool:
        return self._scaler is not None and self._scaler.overflow

    @property
    def loss_scale(self) -> float:
        return self._scaler.loss_scale if self._scaler is not None else 1.0

    @property
    def loss_scaler(self):
        """DeepSpeed's loss scaler the fp16 job steps with (checkpoints record its state), or None."""
        return self._scaler.scaler if self._scaler is not None else None

    def _unscaled(self) -> bool:
        """Whether this step's gradients are unscaled and finite on every rank (always, outside fp16)."""
        return self._scaler is None or self._scaler.unscale([g for g, _ in shards.local_grads(self.model)])

    @property
    def ready_for_checkpoint(self) -> bool:
        return self._optimizer is not None

    @property
    def optimizer_internals(self):
        """DeepSpeed's ZeRO-3 names scripts read through smp's optimizer (zero_names.py)."""
        from smp_adapter.runtime.engines.mics.zero_names import ZeroNames

        return ZeroNames(self._optimizer, self) if self._optimizer is not None else None

    def _average_over_tp_once(self) -> None:
        if self._tp_average and not self._tp_averaged:
            shards.average_replicated_over_tp(self.model, self.job.groups.tp, self.job.dims.tp)
            self._tp_averaged = True

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` on the model (runtime/clipping.py routes it here): the global norm
        of the whole model from the gradient shards, every shard scaled by the same factor. Replicated
        parameters are first averaged over the TP group, as the step would, so the norm is the step's."""
        self._average_over_tp_once()
        if not self._unscaled():
            return math.inf  # an fp16 overflow on some rank: the step will be skipped, as torch's GradScaler would
        return shards.clip(self.model, max_norm, self._tp_group, self.job.groups.sdp)

    def optimizer_step(self, optimizer, clip_norm) -> None:
        self._average_over_tp_once()
        self._tp_averaged = False
        if not self._unscaled():  # fp16 overflow on some rank: every rank skips the update
            self.last_grad_norm = math.inf  # as DeepSpeed's ZeRO-3 reports an overflowed step
            self._scaler.finish_step(self.model.module.parameters())
            return
        # optimizer.clip_master_grads(n) for this step, else sdp_gradient_clipping (smp's default 1.0; 0 = off)
        if clip_norm is None and self.job.cfg.sdp_gradient_clipping > 0:
            clip_norm = self.job.cfg.sdp_gradient_clipping
        # the norm every step, as DeepSpeed's ZeRO-3 keeps it (scripts log optimizer._global_grad_norm)
        self.last_grad_norm = shards.clip(self.model, clip_norm if clip_norm is not None else math.inf, self._tp_group,
                                          self.job.groups.sdp)
        optimizer.step()
        if self._scaler is not None:
            self._scaler.finish_step(self.model.module.parameters())

    def zero_grad(self, optimizer, set_to_none: bool) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def _tp_group(self):
        """The TP group split parameters' norms also sum over, or None without tensor parallelism."""
        return self.job.groups.tp if self.job.dims.tp > 1 else None

    def param_shard_group(self):
        return self.job.groups.sdp

    def optimizer_state_dict(self, optimizer) -> dict:
        from smp_adapter.runtime.engines.base import refuse_full_sharded_optimizer_state

        refuse_full_sharded_optimizer_state()

    def optimizer_local_state_dict(self, optimizer) -> dict:
        return shards.to_local_tree(self._optimizer.state_dict())  # the torch optimizer smp's wraps

    def load_optimizer_state_dict(self, optimizer, sd: dict) -> None:
        shards.load_optimizer_local(self._optimizer, sd)

    # -- partial checkpoints: per-rank files and layout-independent pieces (checkpoint.py) ------------
    @property
    def torch_optimizer(self):
        """The torch optimizer smp.DistributedOptimizer wraps (it steps the shards), or None."""
        return self._optimizer

    def save_partial(self, io, optimizer) -> dict:
        from smp_adapter.runtime.engines.mics import checkpoint

        return checkpoint.save(io, self, optimizer)

    def load_partial(self, io, optimizer, strict: bool, load_optimizer: bool) -> None:
        from smp_adapter.runtime.engines.mics import checkpoint

        checkpoint.load(io, self, optimizer, strict, load_optimizer)

    def load_universal(self, folder, universal: dict) -> None:
        from smp_adapter.runtime.engines.mics import checkpoint

        checkpoint.load_universal(self, Path(folder), universal)
