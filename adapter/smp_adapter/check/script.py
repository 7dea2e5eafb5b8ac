"""Static check of a training script: which smp v1 APIs it uses and whether smp-adapter runs them.

The script is parsed with ``ast``, never executed. Reported, with line numbers:
  * every ``smp.<name>`` (whatever alias ``smdistributed.modelparallel.torch`` was imported as),
    names imported ``from smdistributed.modelparallel.torch[.sub] import X``, ``smp.nn.X``,
    ``smp.amp.GradScaler``, ``smp.optimizers.X``, ``...patches.checkpoint``;
  * every attribute read on objects made by ``smp.DistributedModel(...)`` / ``smp.DistributedOptimizer(...)``
    and on ``smp.state`` (also as ``state_mod.state`` or a name bound to it), against the real classes
    (check/api.py: what the runtime provides);
  * keyword arguments of calls of smp callables and wrapper methods, against their real signatures;
    ``model_creation`` keywords the runtime accepts without carrying them out;
  * option dicts given to ``smp.init({...})`` (literal, or a name bound to a literal), validated
    with ``SMPConfig.from_dict``;
  * the NVIDIA apex names the script and its own modules beside it use (smp v1's containers had apex;
    smp-adapter does not install it), and whether the run gets real apex or smp-adapter's apex
    fallback for each (check/apex_names.py);
  * imports of the script and of its own modules beside it that the environment ``check`` runs in
    cannot find (check/local.py missing_imports; CUDA-only packages such as flash_attn named so);
  * CPU blockers (``torch.cuda.set_device``, ``torch.device("cuda")``, ``.cuda()``) not guarded by
    ``torch.cuda.is_available()``, and known slips (``vit.encoder.layer``, ``optim.AdaDelta``).
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smp_adapter.check import api as provided
from smp_adapter.config.dims import ENGINE_RULE, ENGINE_WORDS
from smp_adapter.parallel.hf_hooks import HOOKED as HF_HOOKED
from smp_adapter.check.apex_names import helper_uses, status as apex_status, uses_in as apex_uses_in
from smp_adapter.check.local import APEX_ROOTS, GPU_ONLY_PACKAGES, imported_roots, missing_imports, module_files
from smp_adapter.translate.kernels import SWITCHES, model_creation_switch

SMP = "smdistributed.modelparallel.torch"
SMP_ROOT = "smdistributed.modelparallel"
SMP_TEST = "smdistributed.modelparallel.test.torch"  # smp's test helpers (the AWS BERT example imports them)
SUPPORTED, PARTIAL, UNSUPPORTED, NEEDS_GPU, ERROR, UNKNOWN = (
    "supported", "partial", "unsupported", "needs-gpu", "error", "unknown")
FAILING = (UNSUPPORTED, ERROR, UNKNOWN)  # a script using any of these does not run as-is
MISSING = "environment"  # Use.kind of an import the environment cannot find
LAUNCH_FLAG = "launch"  # Use.kind of what needs a flag of smp-adapter launch
MP_PARAMETERS_NOTE = ("smp-adapter launch passes SageMaker's --mp_parameters argument, which HfArgumentParser refuses on "
                      "transformers 5 (TrainingArguments has no mp_parameters field there): launch with --no-mp-parameters")


def _refuses_mp_parameters(call: ast.Call) -> bool:
    """``parser.parse_args_into_dataclasses()`` without ``return_remaining_strings=True``, with the installed
    transformers' TrainingArguments lacking ``mp_parameters`` (5.0 removed it; read from the version, no import)."""
    if any(k.arg == "return_remaining_strings" and not (isinstance(k.value, ast.Constant) and not k.value.value)
           for k in call.keywords):
        return False
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0]) >= 5
    except Exception:  # noqa: BLE001 - not installed, or an unreadable version: nothing to say
        return False

_TP = "Megatron-core tensor-parallel layers; see docs"
# pp > 1 runs on torch.distributed.pipelining (smp_adapter.runtime.engines.pipeline)
_PP = "stage marks for pipeline_parallel_degree > 1, carried out by torch.distributed.pipelining (see docs/pipeline.md)"
_S, _P, _U = SUPPORTED, PARTIAL, UNSUPPORTED


def _kernel(name: str) -> str:
    """What an smp kernel switch becomes, in translate/kernels.py's words (the one home)."""
    return SWITCHES[name].note()



# THE support table: API name (relative to smdistributed.modelparallel.torch) -> (status, note).
# "DistributedModel.x" / "DistributedOptimizer.x" are methods of the wrapped objects.
SUPPORT: dict[str, tuple[str, str]] = {
    **{n: (_S, "") for n in ("init", "is_initialized", "step", "StepOutput", "state", "model_creation",
                             "set_activation_checkpointing", "register_parameter", "save", "load",
                             "save_checkpoint", "resume_from_checkpoint", "exceptions")},
    "is_tracing": (_S, "always False: there is no tracing pass"),
    "DistributedModel": (_S, ENGINE_RULE),
    "DistributedOptimizer": (_S, "the optimizer of the model's engine"),
    "delay_param_initialization": (_S, "deepspeed.zero.Init under sharded data parallel; otherwise parameters are "
                                   "created without storage and each rank materialises only what it keeps (its "
                                   "pipeline stage) with the undelayed values"),
    **{f"{g}{w}": (_S, "") for g in ("", "local_", "dp_", "mp_", "pp_", "tp_", "rdp_") for w in ("rank", "size")},
    **{f"get_{g}_group": (_S, "list of global ranks") for g in ("dp", "mp", "pp", "tp", "rdp")},
    **{f"get_{g}_process_group": (_S, "") for g in ("world", "dp", "mp", "pp", "tp", "rdp")},
    **{n: (_S, "") for n in ("CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP", "PP_GROUP", "TP_GROUP",
                             "RDP_GROUP")},
    **{n: (_S, "pickled objects over a gloo group") for n in ("broadcast", "send", "recv_from", "allgather")},
    **{n: (_S, "") for n in ("barrier", "dp_barrier", "mp_barrier")},
    "partition": (_P, _PP), "set_partition": (_P, _PP),
    **{n: (_P, _TP) for n in ("tensor_parallelism", "set_tensor_parallelism", "tp_register", "tp_register_with_module")},
    "nn": (_P, _TP),
    **{f"nn.{n}": (_P, _TP) for n in ("DistributedModule", "DistributedLinear", "DistributedEmbedding",
                                       "DistributedTransformerLMHead", "DistributedTransformer",
                                       "DistributedTransformerLayer", "DistributedAttentionLayer",
                                       "DistributedTransformerOutputLayer")},
    "nn.FusedLayerNorm": (_S, "torch.nn.LayerNorm (isinstance accepts any nn.LayerNorm, as smp's own layers were "
                              "FusedLayerNorm); " + _kernel("nn.FusedLayerNorm")),
    "nn.FlashAttentionLayer": (_S, _kernel("nn.FlashAttentionLayer")),
    "nn.huggingface.t5": (_S, "translation functions validate and pass through"),
    "utils": (_S, ""), "utils.rmsg": (_S, "'[rank] message'"),
    "utils.get_distribution_axis": (_S, "split axis of a TP parameter, None otherwise"),
    "state_mod": (_S, ""), "state_mod.state": (_S, "the same object as smp.state"),
    "test.torch.utils": (_S, ""), "test.torch.utils.dump_model": (_S, "records local weights, gradients, output, loss"),
    "test.torch.utils.verify": (_S, "compares with a dump_model record"),
    "nn.huggingface": (_S, "translation functions validate and pass through: smp-adapter's full state dict "
                           "already has the Hugging Face layout"),
    **{f"nn.huggingface.{family}.{getter}": (_P, f"smp v1's hooks for {cls}: registering {cls} with them keeps its "
                                                 "in-place split on Megatron-core layers (same function, Hugging Face "
                                                 "state-dict keys), not a rebuild as an smp.nn module")
       for (family, getter), (_, cls) in HF_HOOKED.items()},
    "model": (_S, "smp.model.DistributedModel, the module path transformers' Trainer checks"),
    "amp": (_S, ""), "amp.GradScaler": (_S, "torch.amp.GradScaler, overflow agreed over all ranks (pipeline stages too)"),
    "optimizers": (_S, ""), "optimizers.FusedAdam": (_S, _kernel("optimizers.FusedAdam")),
    "optimizers.FusedLamb": (_S, _kernel("optimizers.FusedLAMB")),
    "optimizers.FusedLAMB": (_S, _kernel("optimizers.FusedLAMB")),
    "optimizers.FusedNovoGrad": (_S, _kernel("optimizers.FusedNovoGrad")),
    "patches": (_S, ""), "patches.checkpoint": (_S, ""),
    "patches.checkpoint.checkpoint": (_S, "torch.utils.checkpoint (non-reentrant)"),
    "patches.checkpoint.checkpoint_sequential": (_S, "torch.utils.checkpoint per segment"),
    **{f"DistributedModel.{m}": (_S, "") for m in (
        "backward", "get_module", "module", "partitioned", "local_parameters", "local_named_parameters",
        "local_buffers", "local_named_buffers", "local_modules", "local_named_modules", "state_dict",
        "local_state_dict", "load_state_dict", "register_post_partition_hook", "register_post_step_hook", "cpu",
        "distributed_modules", "is_distributed_parameter", "is_distributed_buffer", "is_scaled_batch_parameter",
        "is_scaled_batch_buffer", "default_reducer_named_parameters", "scaled_batch_reducer_named_parameters")},
    "DistributedModel.virtual_named_parameters": (_S, ""),
    "DistributedModel.join": (_U, "give every data-parallel rank the same number of batches "
                                  "(DistributedSampler, drop_last=True)"),
    "DistributedModel.register_comm_hook": (_U, "remove it: the engine averages gradients over the data-parallel group"),
    **{f"DistributedOptimizer.{m}": (_S, "") for m in ("step", "zero_grad", "local_state_dict", "load_state_dict",
                                                         "clip_master_grads")},
    "DistributedOptimizer.state_dict": (_S, "full state; under optimizer-state sharding (shard_optimizer_state, "
                                            "sharded_data_parallel_degree > 1) it raises: use local_state_dict() "
                                            "or smp.save_checkpoint"),
}
_NAMESPACES = {"nn", "amp", "optimizers", "patches", "patches.checkpoint", "utils", "state_mod", "test.torch.utils"}  # their unknown members are unknown
_WRAPPERS = ("DistributedModel", "DistributedOptimizer")
_GPU_CALLS = ("torch.cuda.set_device", "torch.cuda.current_device", "torch.cuda.synchronize")
GPU_NOTE = ("a GPU call: through smp-adapter launch on CPU ranks it runs on the CPU (CUDA on CPU ranks); run "
            "directly (python script.py) on a machine without GPUs it fails")


@dataclass(frozen=True)
class Use:
    line: int
    col: int
    expr: str  # as written in the script
    name: str  # table key, option key, or what was flagged
    kind: str  # api | import | method | keyword | options | gpu | compat | apex | environment
    status: str
    note: str = ""


def lookup(name: str) -> tuple[str, str, str]:
    """(table key, status, note) of an API name: the longest table entry covering it (attribute
    chains such as ``state.cfg.fp16`` -> ``state``, once ``cfg`` is known to be an attribute of
    smp.state), or UNKNOWN."""
    for state in ("state.", "state_mod.state."):
        attr = name[len(state):].split(".")[0] if name.startswith(state) else None
        if attr in provided.pre_1_10_state_names():
            return (state + attr, UNSUPPORTED, provided.pre_1_10_fp16_note())
        if attr and not provided.state_attribute(attr):
            return (state + attr, UNKNOWN, f"smp.state has no attribute {attr!r} in smp-adapter "
                    "(smp_adapter.runtime.state.State): AttributeError")
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in SUPPORT:
            if i < len(parts) and key in _NAMESPACES:
                break
            return (key, *SUPPORT[key])
    close = difflib.get_close_matches(name, list(SUPPORT), n=1, cutoff=0.85)  # typos, not look-alike names
    hint = f"did you mean smp.{close[0]}? " if close else ""
    return name, UNKNOWN, f"{hint}not an smp v1 API that smp-adapter knows: smp.{name} fails with AttributeError"


class _Checker:
    def __init__(self, tree: ast.Module, options_only: bool = False, path: str | None = None):
        self.tree, self.uses, self.path = tree, [], path  # path: to read the script's own modules beside it
        self.options_only = options_only  # only what smp.init is given (launch): no check that reads the runtime
        self.hf_parser = any(isinstance(n, ast.alias) and n.name.split(".")[-1] == "HfArgumentParser" or
                             isinstance(n, ast.Attribute) and n.attr == "HfArgumentParser" for n in ast.walk(tree))
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.bindings: dict[str, str] = {}  # local name -> full dotted path it was imported as
        self.wrapped: dict[str, str] = {}  # source text of a variable -> "DistributedModel" / "DistributedOptimizer"
        # where a plain name is bound, by scope (innermost function, or the module): a script's `model`
        # is not always the wrapped one (an argparse group in parse_args, the plain model before wrapping)
        self.wrapped_at: dict[tuple[ast.AST, str], int] = {}  # (scope, name) -> first line it is wrapped
        self.bound: set[tuple[ast.AST, str]] = set()  # (scope, name) assigned there
        self.params: set[tuple[ast.AST, str]] = set()  # (function, parameter name)
        self.literals: dict[str, list[tuple[int, ast.AST]]] = {}  # name -> [(line, value)] of assignments
        self.steps: dict[str, str] = {}  # @smp.step function -> what it returns (step_functions)
        self.step_bound: dict[str, list[tuple[int, bool]]] = {}  # name -> [(line, holds a StepOutput)] per binding
        self.sharded = False  # the options shard optimizer state: a full optimizer state_dict raises
        self.engine: str | None = None  # ParallelDims.engine of the literal smp.init options, if it is settled
        self.init_options: dict | None = None  # the literal dict given to smp.init, if any

    def add(self, node: ast.AST, expr: str, name: str, kind: str, status: str, note: str = "") -> None:
        if status in FAILING and kind in ("method", "keyword"):
            branch = self.branch_of(node)
            if branch is not None:  # e.g. the templates' `if args.fp16:` path: the script runs until it is taken
                status, note = PARTIAL, f"only when `if {ast.unparse(branch.test)}:` (line {branch.lineno}) is taken: {note}"
        self.uses.append(Use(node.lineno, node.col_offset + 1, expr, name, kind, status, note))

    def branch_of(self, node: ast.AST) -> ast.If | ast.While | None:
        """The innermost ``if`` / ``while`` whose body (not test) holds ``node``."""
        while node in self.parents:
            child, node = node, self.parents[node]
            if isinstance(node, (ast.If, ast.While)) and child is not node.test:
                return node
        return None

    def run(self) -> list[Use]:
        if not self.options_only:
            self.visit_apex()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.bindings[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.bindings[a.asname or a.name] = f"{node.module}.{a.name}"
                    full = f"{node.module}.{a.name}"
                    relative = (full[len(SMP) + 1:] if (full + ".").startswith(SMP + ".") else
                                full[len(SMP_ROOT) + 1:] if (full + ".").startswith(SMP_TEST + ".") else None)
                    if relative is not None:
                        key, status, note = lookup(relative)
                        self.add(node, f"from {node.module} import {a.name}", key, "import", status, note)
        self.steps = step_functions(self.tree, self.smp_api)
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                self.params |= {(node, p.arg) for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bound.add((self.scope_of(node), node.id))
            elif isinstance(node, ast.Assign):
                wrapper = self.smp_api(node.value.func) if isinstance(node.value, ast.Call) else None
                value_path = self.full_path(node.value)
                self.bind_step_outputs(node)
                for target in node.targets:
                    if wrapper in _WRAPPERS:
                        self.wrapped[ast.unparse(target)] = wrapper
                        if isinstance(target, ast.Name):
                            key = (self.scope_of(node), target.id)
                            self.wrapped_at[key] = min(node.lineno, self.wrapped_at.get(key, node.lineno))
                    if isinstance(target, ast.Name):
                        self.literals.setdefault(target.id, []).append((node.lineno, node.value))
                        if value_path in (f"{SMP}.state", f"{SMP}.state_mod.state"):  # st = smp.state
                            self.bindings[target.id] = value_path
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self.smp_api(node.func) == "init":
                self.visit_init(node)
            if self.options_only:
                continue
            if isinstance(node, (ast.Attribute, ast.Name)):
                self.visit_ref(node)
            if isinstance(node, ast.Call):
                self.visit_call(node)
        if not self.options_only and self.path and Path(self.path).is_file():
            for m in missing_imports(self.path):  # the script cannot start here: said in the verdict
                self.uses.append(Use(m.line, m.col, m.statement, m.module, MISSING,
                                     PARTIAL if m.conditional else UNSUPPORTED, m.note()))
        seen, uses = set(), []
        if self.sharded:
            self.uses = [Use(u.line, u.col, u.expr, u.name, u.kind, PARTIAL, u.note)
                         if u.name == "DistributedOptimizer.state_dict" else u for u in self.uses]
        if self.engine:  # the options in the script settle the engine: name it, not the rule
            note = f"{ENGINE_WORDS[self.engine]}, from the smp.init options (launch-time options override them)"
            self.uses = [Use(u.line, u.col, u.expr, u.name, u.kind, u.status, note)
                         if u.name == "DistributedModel" and u.note == ENGINE_RULE else u for u in self.uses]
        for u in sorted(self.uses, key=lambda u: (u.line, u.col)):  # stable: a line's uses in found order
            if (u.line, u.expr, u.name, u.status) not in seen:  # the same call twice on one line: once
                seen.add((u.line, u.expr, u.name, u.status))
                uses.append(u)
        return uses

    def full_path(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.bindings:
            return None
        return ".".join([self.bindings[node.id], *reversed(parts)])

    def smp_api(self, node: ast.AST) -> str | None:
        path = self.full_path(node)
        return path[len(SMP) + 1:] if path and path.startswith(SMP + ".") else None

    def scope_of(self, node: ast.AST) -> ast.AST:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return node
        return self.tree

    def bind_step_outputs(self, node: ast.Assign) -> None:
        """Record each name this assignment binds, and whether it now holds a StepOutput: ``out =
        train_step(...)`` / ``loss, logits = train_step(...)``, as the step function's returns say."""
        call = node.value.func.id if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) else None
        shape = self.steps.get(call)
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.step_bound.setdefault(target.id, []).append((node.lineno, shape == "one"))
            elif isinstance(target, (ast.Tuple, ast.List)):
                for name in (t for t in target.elts if isinstance(t, ast.Name)):
                    self.step_bound.setdefault(name.id, []).append((node.lineno, shape == "tuple"))

    def owner_of(self, node: ast.AST) -> str | None:
        """What smp made ``node``: a wrapper (wrapper_of), or the StepOutput of a step call
        (``train_step(...)``, ``train_step(...)[0]`` when the step returns a tuple)."""
        call = node.value if isinstance(node, ast.Subscript) else node
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.steps:
            shape = self.steps[call.func.id]
            return "StepOutput" if (shape == "one") == (node is call) else None
        if isinstance(node, ast.Name) and node.id in self.step_bound:  # its last binding on an earlier line says
            earlier = sorted((line, held) for line, held in self.step_bound[node.id] if line < node.lineno)
            if earlier:  # (ast.walk is breadth-first: the bindings come unsorted)
                return "StepOutput" if earlier[-1][1] else self.wrapper_of(node)
        return self.wrapper_of(node)

    def wrapper_of(self, node: ast.AST) -> str | None:
        """"DistributedModel" / "DistributedOptimizer" if ``node`` denotes a wrapped object. A plain
        name: from its wrapping line on in the scope that wraps it; elsewhere a parameter or a free
        name of that name is taken to be it (``def train(model, optimizer)``), a local one is not."""
        wrapper = self.wrapped.get(ast.unparse(node))
        if not wrapper or not isinstance(node, ast.Name):
            return wrapper  # attribute targets (self.model = ...) go by their text
        key = (self.scope_of(node), node.id)
        if key in self.wrapped_at:
            return wrapper if node.lineno >= self.wrapped_at[key] else None
        return None if key in self.bound and key not in self.params else wrapper

    def visit_ref(self, node: ast.AST) -> None:
        parent = self.parents.get(node)
        owner = self.owner_of(node.value) if isinstance(node, ast.Attribute) else None
        if owner and isinstance(node.ctx, ast.Load):  # setting an attribute creates it: nothing to check
            self.add(node, ast.unparse(node), f"{owner}.{node.attr}", "method", *_wrapper_status(owner, node.attr))
        if isinstance(parent, ast.Attribute) and parent.value is node or isinstance(getattr(node, "ctx", None), ast.Store):
            return  # only whole attribute chains, and no assignment targets
        text = ast.unparse(node)
        api = self.smp_api(node)
        if api:
            key, status, note = lookup(api)
            self.add(node, text, key, "api", status, note)
        if ".encoder.layer" in text and "vit" in text.split(".encoder.layer")[0].split(".")[-1].lower() \
                and not self.new_name_first(node, "layers"):
            self.add(node, text, "vit.encoder.layer", "compat", ERROR,
                     "transformers 5 moved ViT's encoder layers to vit.layers: use "
                     "getattr(vit, 'layers', None) or vit.encoder.layer")
        if (self.full_path(node) or "").endswith("optim.AdaDelta"):
            self.add(node, text, "torch.optim.AdaDelta", "compat", ERROR, "torch spells it torch.optim.Adadelta")

    def visit_call(self, node: ast.Call) -> None:
        path = self.full_path(node.func) or ""
        if isinstance(node.func, ast.Attribute) and node.func.attr == "parse_args_into_dataclasses" \
                and self.hf_parser and _refuses_mp_parameters(node):
            self.add(node, ast.unparse(node), "HfArgumentParser.parse_args_into_dataclasses", LAUNCH_FLAG, PARTIAL,
                     MP_PARAMETERS_NOTE)
        first = node.args[0] if node.args else None
        cuda_arg = isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("cuda")
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if (path in _GPU_CALLS or path == "torch.device" and cuda_arg or attr == "cuda" and not path
                or attr == "to" and cuda_arg) and not self.guarded(node):
            self.add(node, ast.unparse(node), path or f".{attr}()", "gpu", NEEDS_GPU, GPU_NOTE)
        if not any(kw.arg is None for kw in node.keywords):  # a **kwargs splat: its keys are unknown here
            self.check_arguments(node)

    def check_arguments(self, call: ast.Call) -> None:
        """Keywords (and too many positional arguments) the real callable refuses; model_creation
        keywords the runtime accepts without carrying them out."""
        api = self.smp_api(call.func)
        owner = self.owner_of(call.func.value) if isinstance(call.func, ast.Attribute) else None
        if api in SUPPORT:  # a table entry itself (smp.save), not an attribute chain (smp.state.cfg.x)
            name, sig = api, provided.smp_signature(api)
        elif owner:
            name, sig = f"{owner}.{call.func.attr}", provided.method_signature(owner, call.func.attr)
        else:
            return
        keywords = {kw.arg: kw for kw in call.keywords}
        positional = None if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)
        display = f"smp.{name}" if api else name
        for kw, note in provided.call_problems(sig, positional, list(keywords), display) if sig else ():
            where = keywords[kw] if kw else call
            self.add(where, ast.unparse(where), f"{name}({kw}=)" if kw else f"{name}()", "keyword", ERROR, note)
        if api == "model_creation":
            for kw, node in keywords.items():  # kernel switches carried out: say what each becomes
                switch = model_creation_switch(kw) if kw else None
                if switch and switch.carried_out and not (isinstance(node.value, ast.Constant) and not node.value.value):
                    self.add(node, ast.unparse(node), f"model_creation({kw}=)", "keyword", SUPPORTED, switch.note())
            for kw, reason in provided.model_creation_not_carried_out().items():
                value = keywords[kw].value if kw in keywords else None
                if value is not None and not (isinstance(value, ast.Constant) and not value.value):  # asked for
                    self.add(keywords[kw], ast.unparse(keywords[kw]), f"model_creation({kw}=)", "keyword", PARTIAL,
                             f"smp.model_creation({kw}=...) is not carried out: {reason}")

    def visit_apex(self) -> None:
        """Each apex name the script uses, where it first appears with each status (a refused name
        under an ``if`` and unconditionally: both); then those its own modules beside it use (the GPT
        templates' fp16/ package), at the script's import of that module."""
        seen: set[tuple[str, str]] = set()
        for use in apex_uses_in(self.tree):
            state, note = apex_status(use)
            if (use.name, state) not in seen:
                seen.add((use.name, state))
                self.uses.append(Use(use.line, use.col, use.expr, use.name, "apex", state, note))
        if not (self.path and Path(self.path).is_file()):
            return
        base, followed = Path(self.path).resolve().parent, set()
        for node in ast.walk(self.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for root, level in imported_roots(node):
                if level or root in followed or root in APEX_ROOTS or not module_files(base, root):
                    continue
                followed.add(root)
                for where, use in helper_uses(self.path, root):
                    state, note = apex_status(use)
                    if (use.name, state) not in seen:
                        seen.add((use.name, state))
                        self.add(node, ast.unparse(node), use.name, "apex", state,
                                 f"in the script's own module {root} ({where}:{use.line}): {note}")

    def visit_init(self, node: ast.Call) -> None:
        if node.args:
            self.check_options(node, node.args[0])
        elif not node.keywords and self.init_options is None:
            self.init_options = {}

    def new_name_first(self, node: ast.AST, new: str) -> bool:
        """``node`` is the old spelling's fallback: taken only when the new name is absent
        (``x.layers if hasattr(x, "layers") else x.encoder.layer``, ``getattr(x, "layers", None) or ...``)."""
        child = node
        while child in self.parents:
            parent = self.parents[child]
            if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test and new in ast.unparse(parent.test):
                return True
            if isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.Or) and \
                    any(new in ast.unparse(v) for v in parent.values[:parent.values.index(child)]):
                return True
            child = parent
        return False

    def guarded(self, node: ast.AST) -> bool:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and "is_available" in ast.unparse(node.test):
                return True
        return False

    def check_options(self, call: ast.Call, arg: ast.AST) -> None:
        from smp_adapter.config.options import SMPConfig
        from smp_adapter.errors import SMPConfigError

        if isinstance(arg, ast.Name):  # the last assignment before the call
            earlier = [v for line, v in self.literals.get(arg.id, []) if line <= call.lineno]
            arg = earlier[-1] if earlier else arg
        try:
            options = ast.literal_eval(arg)
            assert isinstance(options, dict)
        except (ValueError, TypeError, SyntaxError, AssertionError):
            self.add(call, ast.unparse(call), "options", "options", SUPPORTED,
                     "options not checked (not a literal dict); launch-time SM_HP_MP_PARAMETERS override them")
            return
        self.init_options = options
        expr = f"smp.init({', '.join(f'{k}={v!r}' for k, v in options.items())})"
        try:
            cfg = SMPConfig.from_dict(options)
        except SMPConfigError as exc:
            for problem in exc.problems:
                self.add(call, expr, problem.key, "options", ERROR, str(problem))
            return
        if cfg.pipeline_parallel_degree > 1:
            self.add(call, expr, "pipeline_parallel_degree", "options", *_pipeline_status(cfg))
        if cfg.tensor_parallel_degree > 1:
            self.add(call, expr, "tensor_parallel_degree", "options", PARTIAL, _TP)
        for warning in cfg.warnings:
            self.add(call, expr, "options", "options", PARTIAL, warning)
        self.sharded |= cfg.shard_optimizer_state or cfg.sharded_data_parallel_degree > 1
        # the engine these options get, where it does not depend on the world size (MiCS does)
        self.engine = ("pipeline" if cfg.pipeline_parallel_degree > 1 else
                       "deepspeed" if cfg.sharded_data_parallel_degree == 1 else None)
        if not any(u.kind == "options" and u.line == call.lineno for u in self.uses):
            self.add(call, expr, "options", "options", SUPPORTED, "valid smp options")


def step_functions(tree: ast.Module, smp_api) -> dict[str, str]:
    """Name -> "one" / "tuple" for each function decorated with ``@smp.step`` (bare or called) whose
    returns say what it gives back: one StepOutput (every return a single value), or a tuple of them
    (every return a tuple literal). Functions returning dicts or lists, or mixing the two, are left out:
    their results are not StepOutputs themselves."""
    found = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not any(
                smp_api(d.func if isinstance(d, ast.Call) else d) == "step" for d in fn.decorator_list):
            continue
        returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
        shapes = {"tuple" if isinstance(r, ast.Tuple) else "other" if isinstance(
            r, (ast.Dict, ast.List, ast.ListComp, ast.DictComp, ast.Set, ast.Constant)) else "one" for r in returns}
        if len(shapes) == 1 and shapes != {"other"}:
            found[fn.name] = shapes.pop()
    return found


def _wrapper_status(owner: str, attr: str) -> tuple[str, str]:
    if f"{owner}.{attr}" in SUPPORT:  # the table's notes (and refusals: join, register_comm_hook) come first
        return SUPPORT[f"{owner}.{attr}"]
    return provided.wrapper_attribute(owner, attr) or (UNKNOWN, provided.unknown_wrapper_note(owner, attr))


def _pipeline_status(cfg) -> tuple[str, str]:
    # combinations pp > 1 cannot run (sharded_data_parallel_degree) are option errors, reported above
    return PARTIAL, (f"pipeline_parallel_degree = {cfg.pipeline_parallel_degree}: stages on "
                     "torch.distributed.pipelining, not smp's execution server (see docs/pipeline.md)")


@dataclass
class Report:
    path: str
    uses: list[Use]
    init_options: dict | None = None  # what the script passes to smp.init: a literal dict, {} for none, None: unknown

    def counts(self) -> dict[str, int]:
        return {s: sum(u.status == s for u in self.uses) for s in (SUPPORTED, PARTIAL, UNSUPPORTED, NEEDS_GPU, ERROR, UNKNOWN)}

    def exit_status(self, cpu: bool = False) -> int:
        failing = FAILING + ((NEEDS_GPU,) if cpu else ())
        return 1 if any(u.status in failing for u in self.uses) else 0

    def to_dict(self, cpu: bool = False) -> dict[str, Any]:
        return {"script": self.path, "uses": [asdict(u) for u in self.uses], "counts": self.counts(),
                "runs_as_is": self.exit_status(cpu) == 0, "exit_status": self.exit_status(cpu)}

    def text(self, cpu: bool = False) -> str:
        width = min(48, max([len(u.expr) for u in self.uses] + [10]))
        lines = [f"{self.path}: {len(self.uses)} uses checked"]
        for u in self.uses:
            expr = u.expr if len(u.expr) <= width else u.expr[:width - 3] + "..."
            lines.append(f"  line {u.line:<5} {expr:<{width}}  {u.status:<11}  {u.note}".rstrip())
        c = self.counts()
        lines.append("summary: " + ", ".join(f"{n} {s}" for s, n in c.items() if n))
        missing = {u.name: u.note for u in self.uses if u.kind == MISSING and u.status in FAILING}
        if missing:  # every module once, CUDA-only ones first (they cannot be installed on this machine)
            order = sorted(missing, key=lambda name: name not in GPU_ONLY_PACKAGES)
            lines.append("verdict: does not start here: " + "; ".join(missing[name] for name in order))
        elif self.exit_status(cpu):
            lines.append("verdict: does not run as-is (fix the unsupported/unknown/error uses above)")
        elif any(u.kind == LAUNCH_FLAG for u in self.uses):
            lines.append("verdict: runs as-is through smp-adapter launch --no-mp-parameters (transformers 5's "
                         "HfArgumentParser refuses the --mp_parameters argument launch passes otherwise)")
        elif c[NEEDS_GPU]:
            lines.append("verdict: runs as-is (on CPU ranks through smp-adapter launch, which runs the needs-gpu "
                         "lines on the CPU)")
        else:
            lines.append("verdict: runs as-is")
        return "\n".join(lines)


def check_source(source: str, path: str = "<script>") -> Report:
    """Raises SyntaxError for a script that does not parse."""
    checker = _Checker(ast.parse(source, filename=path), path=path)
    return Report(path, checker.run(), checker.init_options)


def script_options(source: str, path: str = "<script>") -> dict | None:
    """``check_source(...).init_options`` without the checks that read the runtime (they import
    torch, a second or more): for launch, which needs only the options. Raises SyntaxError."""
    checker = _Checker(ast.parse(source, filename=path), options_only=True)
    checker.run()
    return checker.init_options
