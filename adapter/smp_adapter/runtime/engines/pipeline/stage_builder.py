"""Building a pipeline rank's stages (``StageBuilder``, held by runtime.py's ``PipelineRunner``): at the
first ``@smp.step``, and again, cut at the same modules, for each other set of model inputs (runtime.py's
signatures). Profile and partition the model on fake stand-ins (stage_memory.py), cut it with ``pipeline()``
(torch.export), thread values read past the next stage (pass_through.py), keep this rank's stage(s) on its device and release the rest, put the tensor-parallel modules back, and
build torch's ``PipelineStage`` objects over smp's PP group. ``build`` returns what the runner keeps
(``BuiltStages``); the steps themselves run in runtime.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from smp_adapter.compat.torch_warnings import torch_pipelining_quiet
from smp_adapter.config.pipeline_schedule import SPLIT_BACKWARD
from smp_adapter.errors import SMPUsageError, UnsupportedFeatureError
from smp_adapter.runtime import activation_checkpoint
from smp_adapter.runtime.engines.pipeline import partition as part, pass_through, stage_memory, surgery, tied, torch_compat
from smp_adapter.runtime.engines.pipeline.idle_time import ComputeClock
from smp_adapter.runtime.engines.pipeline.virtual_stages import skip_self_warmup
from smp_adapter.runtime.partition import partition_mark


def _untraceable(module, e: Exception) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"pipeline parallelism could not split {type(module).__name__}: torch.export failed to trace it "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Make its forward traceable "
        "(no data-dependent Python control flow, tensors/containers as inputs and outputs; for Hugging "
        "Face models pass use_cache=False), or run with pipeline_parallel_degree: 1 and fit the model "
        "with tensor_parallel_degree or sharded_data_parallel_degree")


def _refuse_tensors_of_other_stages(module, stage_modules) -> None:
    """A stage traced for other inputs may reach only tensors this rank kept at the first step (the same cut
    holds the same modules); one that reads another stage's tensor (meta here) would compute nothing real."""
    names = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
    foreign = [names.get(id(t), "?") for t in stage_memory.stage_tensors(stage_modules) if t.is_meta]
    if foreign:
        raise UnsupportedFeatureError(
            f"pipeline parallelism: with these model inputs the stage of this rank reads {foreign[:3]}, which "
            "another stage held when the model was cut at the first step (these inputs take another path "
            "through the model). Give the first step the inputs that reach every module, or run at "
            "pipeline_parallel_degree: 1")


def _watching(clock: ComputeClock, stages) -> ComputeClock:
    clock.watch(stages)
    return clock


def _profiling_failed(module, e: Exception) -> UnsupportedFeatureError:
    """Our own pass failed (the forward on fake tensors that measures modules and finds the output's
    structure, before torch.export is tried): said as ours, not as the model's."""
    return UnsupportedFeatureError(
        f"pipeline parallelism: smp-adapter's profiling pass (one forward of {type(module).__name__} on fake "
        f"tensors, in torch.export's compiling state, before the model is traced and split) failed: "
        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. This is the adapter's pass, not a "
        "verdict that the model cannot be split: a forward that reads tensor values in Python (.item(), "
        "data-dependent if/while) fails there as under torch.export; otherwise report it to smp-adapter with "
        "this traceback. Meanwhile run with pipeline_parallel_degree: 1 and fit the model with "
        "tensor_parallel_degree or sharded_data_parallel_degree")


@dataclass
class BuiltStages:
    """What the first step's build leaves to the runner."""

    stages: list  # this rank's torch PipelineStages, in stage order
    stage_modules: list  # their modules (graph modules cut from the model)
    stage_units: list  # every stage's units (module names), the partition
    stage_calls: list  # the split graph's stage calls (the first one's placeholders: the model inputs it takes)
    local_params: list  # this rank's parameters
    local_keys: set  # this rank's state_dict keys
    tied: list  # (parameter, group of the stages holding it)
    out_spec: object  # the model output's pytree structure
    clock: ComputeClock


class StageBuilder:
    """The first step's build of a ``PipelineRunner``'s stages (the module docstring)."""

    def __init__(self, model, job, layout, stage_index: int, num_stages: int, group, tp_originals: dict):
        """``job``: the smp job (runtime/job.py: options, this rank, its device)."""
        self.model, self.job, self.layout, self.stage_index, self.num_stages, self.group = (
            model, job, layout, stage_index, num_stages, group)
        # qualified name -> module before the TP swap. Modules replaced by a split one (smp.nn layers,
        # marked nn.Linear / nn.Embedding) are traced as their originals and put back into the stage;
        # Hugging Face units split in place (parallel/hf.py) are traced as they are, collectives
        # included (parallel/comm.py, "traced forms")
        self.tp_originals = {n: m for n, m in tp_originals.items() if m is not model.module.get_submodule(n)}
        self.stage_units: list = []
        self._stage_calls: list = []

    def build(self, args, kwargs, first: BuiltStages | None = None) -> BuiltStages:
        """The stages for these inputs. ``first``: the stages of the first step, built for other inputs (another
        set of keywords, other shapes): then the model is traced again with these inputs and cut at the same
        modules, and the new stages are pointed at the same tensors (no parameter is held twice)."""
        from torch.distributed.pipelining.stage import build_stage

        module = self.model.module
        surgery.no_generation_cache(module, self.job.rank)
        # traced with fake stand-ins: no rank ever holds the whole model on its device (stage_memory.py)
        from smp_adapter.runtime.deferred_init import record_of

        record = record_of(module) if first is None else None  # delayed initialisation: the stage's replay
        pipe, out_spec, stage_mods = self._trace(module, args, kwargs, first)
        owners = tied.point_stages_at_model(module, stage_mods)
        ids = self.layout.stages_of(self.stage_index)
        stage_modules = [stage_mods[i] for i in ids]
        for i, mine in zip(ids, stage_modules):
            self._prepare_stage_module(module, i, mine)
        if first is None:  # this rank's stage(s) get their values on its device; every other tensor is released
            stage_memory.keep_stage(module, stage_memory.stage_tensors(stage_modules), record, self.job.device)
            del record  # the other stages' creation records are released with it
            self._originals_to_meta()
        else:
            _refuse_tensors_of_other_stages(module, stage_modules)
        marked = [n for mine in stage_modules for n in surgery.checkpoint_marked(module, mine)]
        if marked and first is None:  # set_activation_checkpointing, lost by torch.export, applied again
            print(f"Activation checkpointing in the stage(s) of pipeline rank {self.stage_index}: {', '.join(marked)}")
        stages = [build_stage(mine, i, pipe.info(), self.job.device, group=self.group)
                  for i, mine in zip(ids, stage_modules)]
        self._prepare_stages(stages)
        if first is not None:  # the same cut holds the same parameters: the first step's groups and lists serve
            return BuiltStages(stages=stages, stage_modules=stage_modules, stage_units=first.stage_units,
                               stage_calls=self._stage_calls, local_params=first.local_params,
                               local_keys=first.local_keys, tied=first.tied, out_spec=out_spec,
                               clock=_watching(first.clock, stages))
        return BuiltStages(
            stages=stages, stage_modules=stage_modules, stage_units=self.stage_units, stage_calls=self._stage_calls,
            local_params=list({id(p): p for m in stage_modules for p in m.parameters()}.values()),
            local_keys={k for m in stage_modules for k in m.state_dict().keys()},
            tied=tied.tie_groups(self, owners), out_spec=out_spec, clock=ComputeClock(stages))

    def _trace(self, module, args, kwargs, first):
        """Profile (the first build only), choose the stages, and cut the model with ``pipeline()``, all on
        fake stand-ins. Returns (the split pipe, the model output's pytree structure, every stage's module)."""
        from torch.distributed.pipelining import pipeline

        cfg, rank = self.job.cfg, self.job.rank
        stand_ins = stage_memory.FakeStandIns([module, *self.tp_originals.values()], self.job.device)
        args, kwargs = stand_ins.inputs((args, kwargs))
        with stand_ins, surgery.originals_swapped_in(module, self.tp_originals), activation_checkpoint.tracing_plain():
            try:
                # the model sees the state torch.export gives it (compiling), so it takes the same paths here
                with stand_ins.mode, torch_compat.compiling_state():
                    prof = part.profile(module, args, kwargs) if first is None else None
                    with torch.no_grad():
                        example_out = module(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a forward that needs values (data-dependent control flow)
                if isinstance(e, (SMPUsageError, UnsupportedFeatureError)):
                    raise
                raise _profiling_failed(module, e) from e
            out_spec = torch.utils._pytree.tree_flatten(example_out)[1]
            if first is not None:
                self.stage_units = first.stage_units  # the same cut, whatever these inputs would weigh
            elif cfg.auto_partition:
                marked = [n for n, m in module.named_modules() if partition_mark(m) is not None]
                if marked and rank == 0:
                    warnings.warn(f"auto_partition is true: smp.partition/set_partition marks are ignored ({marked[:3]}"
                                  f"{'...' if len(marked) > 3 else ''}); set auto_partition: false to use them")
                self.stage_units = part.auto_split(module, prof, self.layout.total, cfg.memory_weight)
            else:
                self.stage_units = part.manual_split(module, prof, self.num_stages, cfg.default_partition)
            if rank == 0 and first is None:
                part.log_assignment(self.stage_units, "auto" if cfg.auto_partition else "manual", self.layout)
            pipe = self._split(pipeline, module, args, kwargs)
            late = self._late_inputs()
            if late:
                # Model inputs first used by a later stage (labels=... of a Hugging Face model, whose loss
                # is computed by the last stage): copied at the very start of forward, they become values
                # of stage 0 that the splitter passes on, stage to stage, like any activation.
                hook = module.register_forward_pre_hook(surgery.CarryInputs(module, late), with_kwargs=True)
                try:
                    pipe = self._split(pipeline, module, args, kwargs)
                finally:
                    hook.remove()
                self._check_inputs_reach_first_stage(module)
            return pipe, out_spec, [pipe.get_stage_module(i) for i in range(self.layout.total)]

    def _prepare_stage_module(self, module, i: int, mine) -> None:
        """Stage ``i``'s traced module made ready to run on this rank (before its torch stage is built)."""
        cfg = self.job.cfg
        surgery.run_generated_code(mine)
        surgery.contiguous_crossing_metadata(mine)
        for name in self.tp_originals:  # the split (TP) modules go back in
            if surgery.has_submodule(mine, name):
                surgery.set_submodule(mine, name, surgery.get_submodule(module, name))
        if i != self.layout.total - 1:
            # activations cross to the next stage in buffers of the traced dtype: an autocast forward's
            # reduced-precision outputs are sent widened (exact), and the next stage's autocast
            # narrows them again for its matmuls
            traced = next((p.dtype for p in mine.parameters() if p.is_floating_point()), torch.get_default_dtype())
            mine.register_forward_hook(surgery.SendableOutputs(traced))
        if i > 0 and cfg.pipeline in SPLIT_BACKWARD:  # the first stage's backward is not split
            surgery.own_outputs_read_inside(mine)
            mine.register_forward_hook(surgery.OwnViewOutputs())

    def _prepare_stages(self, stages) -> None:
        for stage in stages:
            torch_compat.receive_integers(stage)
        if self.job.cfg.pipeline in SPLIT_BACKWARD:
            for stage in stages:
                surgery.merge_weight_groups(stage)
        if self.layout.v_shaped:
            for stage in stages:
                stage.stage_index_to_group_rank = dict(enumerate(self.layout.ranks))
                skip_self_warmup(stage)

    def _originals_to_meta(self) -> None:
        """The pre-split TP modules are traced again for other inputs (another signature), but only their
        shapes are read then (fake stand-ins): their values are released, the modules kept."""
        from smp_adapter.runtime.deferred_init import meta_like, module_tensors, replace_in_place

        model_tensors = {id(t) for t in module_tensors(self.model.module)}
        with torch.no_grad():
            for original in self.tp_originals.values():
                for t in module_tensors(original):
                    if id(t) not in model_tensors and not t.is_meta:
                        replace_in_place(t, meta_like(t))

    def _split(self, pipeline, module, args, kwargs):
        spec = part.split_spec(self.stage_units)
        # pipeline() wraps each split module's forward and never unwraps it; a second split (see
        # _build) would then recurse forever. Put every forward back exactly as it was.
        saved = {name: module.get_submodule(name).__dict__.get("forward") for name in spec}
        try:
            with torch_pipelining_quiet():  # torch's copies of its own LeafSpecs warn
                pipe = pipeline(module, tuple(args), dict(kwargs), split_spec=spec)
        except Exception as e:  # noqa: BLE001 - export failures come in many types
            from smp_adapter.ledger import record as comm_ledger

            if comm_ledger.is_on() and self.job.dims.tp > 1:
                # export maps torch.distributed's collectives to traceable ones by the function objects;
                # the ledger's counting wrappers are other objects, so TP exchanges inside a stage fail
                raise UnsupportedFeatureError(
                    f"pipeline parallelism could not split {type(module).__name__} while the communication ledger is "
                    f"on ({comm_ledger.ENV}): torch.export cannot trace the tensor-parallel exchanges inside the stages "
                    "through the ledger's counting wrappers. Run this layout without the ledger (unset the variable, no "
                    "--comm-ledger), or with prescaled_batch: true, whose exchanges the ledger can count") from e
            raise _untraceable(module, e) from e
        finally:
            for name, forward in saved.items():
                split_module = module.get_submodule(name)
                split_module.__dict__.pop("_orig_forward", None)
                if forward is None:
                    split_module.__dict__.pop("forward", None)
                else:
                    split_module.forward = forward
        if pipe.num_stages != self.layout.total:
            raise UnsupportedFeatureError(
                f"splitting {type(module).__name__} produced {pipe.num_stages} stages instead of {self.layout.total}: "
                "the split points were not on the traced path. Partition manually (auto_partition: false, "
                "smp.partition / smp.set_partition) at modules that run at the top level of forward")
        # values read past the next stage (GPT-2's causal mask) go through the stages in between:
        # torch's multi-stage schedules send only to the next stage, and no torch stage takes the
        # backward of an output read by several stages (pass_through.py)
        pass_through.thread_skipped_values(pipe.split_gm)
        self._stage_calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
        pass_through.refuse_unthreaded(module, self._stage_calls)
        return pipe

    def _late_inputs(self) -> dict[int, list[str]]:
        """{stage: model inputs (placeholders) it reads directly} for stages after the first."""
        late = {}
        for i, node in enumerate(self._stage_calls[1:], start=1):
            used = []
            torch.fx.node.map_arg((node.args, node.kwargs), lambda a: used.append(a) or a)
            names = [a.target for a in used if a.op == "placeholder"]
            if names:
                late[i] = names
        return late

    def _check_inputs_reach_first_stage(self, module) -> None:
        for i, late in self._late_inputs().items():
            if late:
                raise UnsupportedFeatureError(
                    f"pipeline parallelism: the model input(s) {late} of {type(module).__name__} are first used on "
                    f"stage {i}, but model inputs reach only the first stage. Compute what uses them in the step "
                    "function instead (e.g. for Hugging Face models do not pass labels=: take the logits and compute "
                    "the loss in the step body), or partition manually so that their first use is on stage 0")
