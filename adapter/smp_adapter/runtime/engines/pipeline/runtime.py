"""Pipeline execution of a DistributedModel on torch.distributed.pipelining (docs/pipeline.md).

One ``PipelineRunner`` per DistributedModel when pipeline_parallel_degree > 1. On the first
``@smp.step`` call it profiles and partitions the model, cuts it with ``pipeline()`` (torch.export),
keeps this rank's stage module, re-points the stage at the model's own Parameter objects (so the
user's optimizer, built from ``model.parameters()`` before partitioning, updates them), swaps the
replaced tensor-parallel modules back in (Hugging Face units split in place are traced with their
collectives), and builds a traced ``PipelineStage`` over smp's PP group: that first-step build is
stage_builder.py's ``StageBuilder``, which ``PipelineRunner`` holds and runs once; this module runs the steps.

Each step call:
  1. the first stage learns the model inputs of every microbatch by running the step body up to its
     ``model(...)`` call (the call raises ``_Captured``; nothing after it runs there);
  2. a torch schedule runs the stage forwards/backwards (schedules.py; in groups of at most
     ``active_microbatches`` when that bounds smp's own schedules' number in flight), timed (idle_time.py);
  3. on the last stage the schedule's loss function is the step body itself: ``model(...)`` returns
     the microbatch's pipeline output and ``model.backward(loss)`` hands the loss to the schedule
     (divided by the number of microbatches, for smp's gradient average);
  4. the body's per-microbatch return values are broadcast from the last stage over the PP group;
  5. gradients: tied parameters held by several stages are summed over those stages; then the smp
     data-parallel reduction (TP-split parameters over RDP, the others over DP).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime import attention
from smp_adapter.runtime.engines.base import model_dtype
from smp_adapter.runtime.engines.pipeline import surgery
from smp_adapter.runtime.engines.pipeline.idle_time import ComputeClock
from smp_adapter.runtime.engines.pipeline.stage_builder import StageBuilder
from smp_adapter.runtime.engines.pipeline.virtual_stages import StageLayout


class _Captured(Exception):
    def __init__(self, args, kwargs):
        super().__init__("model inputs captured")
        self.args, self.kwargs = args, kwargs


_MANY_SIGNATURES = 8  # sets of model inputs traced before a warning says each costs a trace


class _Signature:
    """The stages of one set of model inputs (and module mode) and the schedules run over them."""

    def __init__(self, built):
        self.built = built
        self.schedules: dict = {}
        self.last_schedule = None


class PipelineRunner:
    def __init__(self, model, job, progress, tp_originals: dict | None = None):
        """``job``: the smp job (runtime/job.py); ``progress``: the live step progress (the microbatch
        being run is written here, the step count read)."""
        self.model = model
        self.job, self.progress = job, progress
        self.num_stages = job.dims.pp  # pipeline ranks; each holds layout.v stages (virtual_stages.py)
        self.stage_index = job.coord.pp  # this rank's position in the pipeline group
        self.layout = StageLayout.from_config(job.cfg, self.num_stages)
        self.group = job.groups.pp
        self._builder = StageBuilder(model, job, self.layout, self.stage_index, self.num_stages, self.group,
                                     tp_originals or {})  # used once, at the first step
        self._stage_calls: list = []
        self.built = False
        self.stages: list = []  # this rank's torch PipelineStages, in stage order
        self.clock = ComputeClock([])  # this rank's compute and schedule time per step (idle_time.py)
        self.stage_modules: list[nn.Module] = []
        self.stage_units: list[list[str]] = []
        self.local_params: list[nn.Parameter] = []
        self.local_keys: set[str] = set()
        self.tied: list[tuple[nn.Parameter, object]] = []  # (parameter, group of the stages holding it)
        self.out_spec = None
        # the stages of every set of model inputs met so far, all cut at the first step's modules, and (on
        # the first stage, which sees the inputs) those sets' signatures, in the same order (signature.py)
        self._signatures: list[_Signature] = []
        self._signature_keys: list = []
        self._current = None
        self._first_built = None  # the first step's BuiltStages (the cut, the parameters, the tied groups)
        self._mode = None
        self._detach_results = True  # run_step sets it (the step's detach_outputs)
        self._autocast = None  # (device type, dtype) active around model(...) in the step body, or None
        self._replay = self._loss = None
        #: fp16/bf16: returns the current loss scale (set by the pipeline engine with the optimizer)
        self.loss_scale_source = None

    @property
    def module(self) -> nn.Module:
        return self.model.module

    def _build(self, args, kwargs) -> None:
        """Cut the model into stages for these inputs (stage_builder.py) and keep what this rank runs: at the
        first step the partition itself; later, for inputs of another signature, the same cut traced again."""
        built = self._builder.build(args, kwargs, self._first_built)
        self._signatures.append(_Signature(built))
        if self._first_built is None:
            self._first_built = built
            self.stage_modules, self.stage_units = built.stage_modules, built.stage_units
            self.local_params, self.local_keys, self.tied, self.clock = (built.local_params, built.local_keys,
                                                                         built.tied, built.clock)
            self.built = True
            self.model.mark_partitioned()
        elif len(self._signatures) == _MANY_SIGNATURES and self.job.rank == 0:
            warnings.warn(f"pipeline parallelism: the model was called with {_MANY_SIGNATURES} different sets of "
                          "inputs (keywords, shapes or values), and each was traced and cut again: give the model "
                          "inputs of fixed shapes (pad batches to one length, drop the last smaller batch)")

    def _use(self, index: int) -> None:
        """Run the stages of signature ``index`` from now on (its traced graph, its schedules)."""
        self._current = self._signatures[index]
        built = self._current.built
        self.stages, self._stage_calls, self.out_spec = built.stages, built.stage_calls, built.out_spec

    def on_partitioned(self, callback) -> None:
        """Run ``callback()`` once the stages exist (now, if they already do)."""
        if self.built:
            callback()
        else:
            handle = self.model.register_post_partition_hook(lambda m, o: (handle.remove(), callback()))

    @property
    def is_first(self) -> bool:
        """This rank holds the first stage (it captures the model inputs)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (it runs the step body): in the V order that is rank 0."""
        return self.stage_index == self.layout.last_rank

    # -- called by DistributedModel ----------------------------------------------------------------
    def forward(self, args, kwargs):
        if self._mode == "capture":
            self._autocast = surgery.autocast_state()  # the stages' forwards run under the same autocast
            raise _Captured(args, kwargs)
        if self._mode == "replay":
            if self._replay is None:
                raise SMPUsageError("with pipeline_parallel_degree > 1 the model may be called once per microbatch "
                                    "inside the step function: call model(...) once and reuse its output")
            out, self._replay = self._replay, None
            return out
        raise SMPUsageError("with pipeline_parallel_degree > 1 call the model inside an @smp.step function "
                            "(out = model(x); model.backward(loss); return out, loss)")

    def backward(self, loss) -> None:
        if self._mode != "replay":
            raise SMPUsageError("with pipeline_parallel_degree > 1 call model.backward(loss) inside the @smp.step "
                                "function, after model(...)")
        self._loss = loss if self._loss is None else self._loss + loss

    # -- the step ----------------------------------------------------------------------------------
    def run_step(self, func, bound_mbs: list, detach: bool):
        m = len(bound_mbs)
        inputs = []
        if self.is_first or not self.built:
            for mb in range(m if self.is_first else 1):
                inputs.append(self._capture(func, bound_mbs[mb]))
        self._stages_for(inputs)
        training = torch.is_grad_enabled() and self.model.training
        results: list = [None] * m
        cfg = self.job.cfg
        active = max(1, min(cfg.active_microbatches, m))
        simple = cfg.pipeline == "simple"
        # smp's schedules honour active_microbatches by running groups; the others order all
        # microbatches themselves (a smaller active_microbatches is refused by the option rules)
        smp_schedule = cfg.pipeline in ("interleaved", "simple", "_only_forward")
        group = active if smp_schedule and (simple or active < self.num_stages) else m
        self._mode, self._detach_results = "replay", detach
        # a traced stage calls attention's aten op, past the functional runtime/attention.py wraps
        compute_dtype = model_dtype(cfg) or torch.get_default_dtype()
        try:
            with attention.math_kernel_for(compute_dtype, self.job.device):
                for start in range(0, m, group):
                    idx = list(range(start, min(start + group, m)))
                    self._run_group(func, bound_mbs, inputs, idx, m, training, simple, results)
        finally:
            self._mode, self._replay, self._loss = None, None, None
        results = self._broadcast_results(results, detach)
        if training:
            self._reduce_gradients()
        return results

    def _stages_for(self, inputs) -> None:
        """Choose (building them when new) the stages traced with this step's model inputs. Only the first
        stage sees the inputs (the others may get placeholder batches), so it names the signature for all:
        its index among those met, or NEW (every rank then traces the model with the first stage's inputs)."""
        from smp_adapter.runtime.engines.pipeline import signature

        key = signature.of_microbatches(inputs, self.model.module) if self.is_first else None
        if not self.built:
            self._build(*self._first_stage_inputs(inputs[0]))  # every rank captured its own inputs
        else:
            index = signature.agree(self._signature_keys, key, self.group, self.is_first, self.job.device)
            if index != signature.NEW:
                self._use(index)
                return
            captured = self._first_stage_inputs(inputs[0] if self.is_first else None)
            with torch.enable_grad():  # traced for training too, as at the first step (an evaluation may come first)
                self._build(*captured)
        self._signature_keys.append(key)
        self._use(len(self._signatures) - 1)

    def _first_stage_inputs(self, captured):
        """Microbatch 0's model inputs as the first stage captured them, on every rank of the PP group.
        Only the first stage's inputs feed the model (smp v1 ignores the other stages'), and scripts
        rely on it: the AWS templates' data pipelines hand the later stages empty placeholder batches.
        Every rank then profiles and traces the model with the same inputs and cuts the same stages."""
        if self.num_stages == 1:
            return captured
        tree = torch.utils._pytree
        payload = [None]
        if self.is_first:  # tensors travel on the CPU, each with the kind of device it was on
            payload = [(tree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, captured),
                        tree.tree_map(lambda t: t.device.type if isinstance(t, torch.Tensor) else None, captured))]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(self.group, 0), group=self.group)
        if self.is_first:
            return captured
        values, devices = payload[0]
        device = self.job.device
        return tree.tree_map(lambda t, d: t.to(device) if isinstance(t, torch.Tensor) and d != "cpu" else t,
                             values, devices)

    def _capture(self, func, bound):
        self._mode = "capture"
        try:
            func(*bound.args, **bound.kwargs)
        except _Captured as c:
            return c.args, c.kwargs
        finally:
            self._mode = None
        raise SMPUsageError("the @smp.step function never called the model: with pipeline_parallel_degree > 1 the "
                            "step function must call model(...) once per microbatch")

    def _run_group(self, func, bound_mbs, inputs, idx, m, training, simple, results) -> None:
        n = len(idx)
        sched = self._schedule(n, training, simple)
        for stage in self.stages:
            stage.has_backward = training
            stage.clear_runtime_states()
        first = [self._stage0_inputs(*inputs[i]) for i in idx] if self.is_first else None
        arg_mbs = [f[0] for f in first] if self.is_first else [() for _ in idx]
        kwarg_mbs = [f[1] for f in first] if self.is_first else [{} for _ in idx]
        if training:
            scale = 1.0 / m if self.model.average_grads_across_microbatches else 1.0

            def loss_fn(output, target):
                mb = idx[int(target)]
                loss = self._run_body(func, bound_mbs[mb], output, results, mb)
                if loss is None:  # the body did not call model.backward: no gradient from this microbatch
                    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
                              if isinstance(t, torch.Tensor) and t.requires_grad]
                    return sum((t.sum() * 0.0 for t in leaves), torch.zeros(()))
                loss_scale = self.loss_scale_source() if self.loss_scale_source is not None else None
                if loss_scale is None:
                    return loss * scale
                return loss.float() * (scale * loss_scale)  # in fp32: the scale may exceed fp16's range

            targets = [torch.tensor(j) for j in range(n)]
            with self._autocast_context():
                sched.run_microbatches(arg_mbs, kwarg_mbs, loss_fn, targets)
        else:
            with self._autocast_context():
                sched.run_microbatches(arg_mbs, kwarg_mbs)
            if self.is_last:
                for j, mb in enumerate(idx):
                    self._run_body(func, bound_mbs[mb], self.stages[-1].output_chunks[j], results, mb)

    def _autocast_context(self):
        """The step body's autocast around model(...), re-entered around the stage forwards (which the
        schedule runs outside the body). Stages after the first see the body only at the first step,
        so they keep that step's autocast setting."""
        import contextlib

        if self._autocast is None:
            return contextlib.nullcontext()
        device_type, dtype = self._autocast
        return torch.autocast(device_type, dtype=dtype)

    def _run_body(self, func, bound, output, results, mb):
        self._replay, self._loss = self._unflatten(output), None
        self.progress.microbatch = mb
        returned = func(*bound.args, **bound.kwargs)
        # detached now when the caller gets detached values anyway: a returned tensor with its graph
        # (the loss) would keep every microbatch's graph until the step ends, and under the split
        # backward that graph still holds what only the input gradient needed (torch's retain_graph)
        results[mb] = torch.utils._pytree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, returned) if self._detach_results else returned
        loss, self._loss, self._replay = self._loss, None, None
        return loss

    def _unflatten(self, output):
        if self.out_spec is None:
            return output
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        if len(leaves) == self.out_spec.num_leaves and not (self.out_spec.num_leaves == 1
                                                              and self.out_spec.is_leaf()):
            return torch.utils._pytree.tree_unflatten(leaves, self.out_spec)
        if self.out_spec.is_leaf() and isinstance(output, (tuple, list)) and len(output) == 1:
            return output[0]
        return output

    def _schedule(self, n: int, training: bool, simple: bool):
        from smp_adapter.runtime.engines.pipeline.schedules import make_schedule

        key, current = (n, training, simple), self._current
        if key not in current.schedules:
            current.schedules[key] = make_schedule(self.stages, n, training, self.job.cfg.pipeline, self.num_stages)
            self.clock.attach(current.schedules[key])
        sched = current.schedules[key]
        if key != current.last_schedule:
            # the stage's buffers were set up by another schedule (train <-> eval, another group size):
            # make this one set them up again (every rank switches at the same call)
            sched.reset_stage_setup()
            current.last_schedule = key
        return sched

    def _broadcast_results(self, results, detach: bool):
        if self.num_stages == 1:
            return results

        def prep(obj):
            return torch.utils._pytree.tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)

        payload = [[prep(r) for r in results] if self.is_last else None]
        src = dist.get_global_rank(self.group, self.layout.last_rank)
        dist.broadcast_object_list(payload, src=src, group=self.group)
        if self.is_last and not detach:
            return results  # keep the graph on the rank that has it
        return payload[0]

    # -- gradients ---------------------------------------------------------------------------------
    def _reduce_gradients(self) -> None:
        last_call = (self.progress.step_calls + 1) % self.model.backward_passes_per_step == 0
        if not last_call:  # gradient accumulation: reduce once, after the last call
            return
        for p, group in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        params = [p for p in self.local_params if p.requires_grad]
        if self.job.dims.tp > 1:
            from smp_adapter.parallel.tensor import current_tp_context, tp_gradient_sync

            tp_gradient_sync(params, current_tp_context())
        rdp_group = self.job.groups.rdp
        if dist.get_world_size(rdp_group) > 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=rdp_group)

    def _stage0_inputs(self, args, kwargs):
        """The first stage's positional inputs: the model's forward arguments named by the traced
        graph's placeholders (torch.export names them after the parameters); unchanged if they do not map."""
        node = self._stage_calls[0]
        signature = inspect.signature(self.model.module.forward)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs
        values = []
        for a in node.args:
            if not (isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.target in bound.arguments):
                return args, kwargs
            values.append(bound.arguments[a.target])
        if node.kwargs:
            return args, kwargs
        return tuple(values), {}

    # -- parameters and state ----------------------------------------------------------------------
    def local_named_parameters(self):
        if not self.built:
            return list(self.model.module.named_parameters())
        local = {id(p) for p in self.local_params}
        return [(n, p) for n, p in self.model.module.named_parameters() if id(p) in local]

    def local_named_buffers(self):
        if not self.built:
            return list(self.model.module.named_buffers())
        return [(n, b) for n, b in self.model.module.named_buffers() if n in self.local_keys]

    def local_named_modules(self):
        if not self.built:
            return list(self.model.module.named_modules())
        prefixes = {k.rpartition(".")[0] for k in self.local_keys}
        return [(n, m) for n, m in self.model.module.named_modules() if n in prefixes]

    def full_state_dict(self, sd: dict) -> dict:
        """Merge the stages' entries of ``sd`` (this rank's full-layout dict) over the PP group."""
        if not self.built:
            return sd
        mine = {k: v for k, v in sd.items() if k in self.local_keys}
        parts = [None] * self.num_stages
        dist.all_gather_object(parts, mine, group=self.group)
        out = dict(sd)
        for p in reversed(parts):
            out.update(p)
        return {k: out[k] for k in sd}

    def local_state_dict(self, sd: dict) -> dict:
        return {k: v for k, v in sd.items() if k in self.local_keys} if self.built else sd
