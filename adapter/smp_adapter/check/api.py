"""What the smp-adapter runtime provides, as ``smp-adapter check`` (check/script.py) sees it.

Read from the runtime itself rather than from hand-written lists, so the check cannot drift from
it: the attributes of ``smp.DistributedModel`` / ``smp.DistributedOptimizer`` objects and of
``smp.state`` (their classes, what their code sets on ``self``), the signatures of smp callables,
and the ``model_creation`` keywords the runtime does not carry out. Only DeepSpeed's ZeRO-optimizer
internals are listed by hand: they live on an optimizer DeepSpeed builds at run time.

The runtime is imported lazily (torch is heavy); importing it needs no process group.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import textwrap

SMP = "smdistributed.modelparallel.torch"

# DeepSpeed's optimizer internals the AWS GPT templates read through smp's optimizer, which
# forwards unknown names to DeepSpeed's optimizer (DistributedOptimizer.__getattr__): they exist
# only when the options make DeepSpeed build that optimizer. tests/unit/test_check.py pins each
# against DeepSpeed's source.
_ZERO3 = "DeepSpeed ZeRO-3 internal: exists under sharded_data_parallel_degree > 1 (AttributeError otherwise)"
ZERO_INTERNALS: dict[str, str] = {
    "fp32_partitioned_groups_flat": _ZERO3,
    "fp16_groups": _ZERO3,
    "ds_param_shard_group": ("ZeRO-3 parameter-shard group: exists under sharded_data_parallel_degree > 1 "
                             "(AttributeError otherwise)"),
    "_global_grad_norm": ("DeepSpeed optimizer internal: exists under sharded_data_parallel_degree > 1, "
                          "shard_optimizer_state or fp16/bf16 (DeepSpeed's optimizer wrappers), and at "
                          "pipeline_parallel_degree > 1 (smp-adapter records it); AttributeError in a plain "
                          "fp32 data-parallel job"),
}

_WRAPPER_MODULES = {"DistributedModel": "smp_adapter.runtime.model",
                    "DistributedOptimizer": "smp_adapter.runtime.optimizer",
                    "StepOutput": "smp_adapter.runtime.step"}  # what an @smp.step function returns
_UNKNOWN_HINT = {
    "DistributedModel": "it is an nn.Module around your model and does not forward other names: use "
                        "model.get_module().{name} for the wrapped model's",
    "DistributedOptimizer": "neither smp's optimizer, DeepSpeed's ZeRO optimizer nor torch.optim.Optimizer "
                            "defines it (a custom optimizer's own attributes are forwarded, but not checked)",
    "StepOutput": "it holds one tensor per microbatch: reduce_mean(), reduce_sum(), concat(), stack(), .outputs, "
                  "or a torch.Tensor method applied to each",
}


def wrapper_class(wrapper: str) -> type:
    return getattr(importlib.import_module(_WRAPPER_MODULES[wrapper]), wrapper)


def state_class() -> type:
    from smp_adapter.runtime.state import State

    return State


def known_attributes(cls: type) -> set[str]:
    """Names an instance of ``cls`` has: the class's (inherited ones, properties and methods
    included), its dataclass fields, and what its code (or a base's) sets on ``self``. dir() is
    read each call, so attributes added to the class later (or monkeypatched) count."""
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for base in cls.__mro__[:-1]:  # object has nothing to add
        names |= _set_on_self(base)
    return names


@functools.lru_cache(maxsize=None)
def _set_on_self(cls: type) -> frozenset[str]:
    """Names the class's source assigns on instances: ``self.x = ...``, ``self.__dict__["x"] = ...``
    (DistributedOptimizer, around its __getattr__) and ``super().__setattr__("x", ...)`` (nn.Module)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # a class without Python source (builtins)
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in (t for top in targets for t in ast.walk(top)):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
            elif (isinstance(target, ast.Subscript) and ast.unparse(target.value) == "self.__dict__"
                  and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                names.add(target.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__":
            names.update(a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return frozenset(names)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def wrapper_attribute(wrapper: str, name: str) -> tuple[str, str] | None:
    """(status, note) of ``<wrapper object>.name`` outside the SUPPORT table; None: not known."""
    if wrapper == "DistributedOptimizer" and name in ZERO_INTERNALS:
        return "partial", ZERO_INTERNALS[name]
    if not is_private(name) and name in known_attributes(wrapper_class(wrapper)):
        return "supported", ""
    if wrapper == "StepOutput" and not is_private(name) and _tensor_method(name):
        return "supported", "a torch.Tensor method: StepOutput applies it to each microbatch's tensor"
    return None


def _tensor_method(name: str) -> bool:
    """StepOutput forwards the callable attributes of torch.Tensor (runtime/step.py, __getattr__)."""
    import torch

    return callable(getattr(torch.Tensor, name, None))


def unknown_wrapper_note(wrapper: str, name: str) -> str:
    why = "a private name" if is_private(name) else _UNKNOWN_HINT[wrapper].format(name=name)
    public = sorted(n for n in known_attributes(wrapper_class(wrapper)) if not n.startswith("_"))
    close = difflib.get_close_matches(name, public, n=1, cutoff=0.85) if not is_private(name) else []  # typos only
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"smp-adapter's {wrapper} has no attribute {name!r} ({hint}{why}): AttributeError"


def pre_1_10_state_names() -> tuple[str, ...]:
    """smp.state internals only smp < 1.10's fp16 path read: the runtime refuses them (runtime/state.py)."""
    from smp_adapter.runtime.state import PRE_1_10_STATE_NAMES

    return PRE_1_10_STATE_NAMES


def pre_1_10_fp16_note() -> str:
    from smp_adapter.runtime.state import PRE_1_10_FP16

    return PRE_1_10_FP16


def state_attribute(name: str) -> bool:
    return not is_private(name) and name in known_attributes(state_class())


def model_creation_not_carried_out() -> dict[str, str]:
    """model_creation keyword -> why smp-adapter accepts it without carrying it out (the runtime's
    table, which also makes model_creation warn at run time)."""
    from smp_adapter.runtime.memory import MODEL_CREATION_NOT_CARRIED_OUT

    return MODEL_CREATION_NOT_CARRIED_OUT


def smp_signature(api: str) -> inspect.Signature | None:
    """Signature of the callable ``smp.<api>`` names (``save``, ``nn.DistributedLinear``: a class's
    is its constructor's), or None."""
    obj = smp_callable(api)
    return signature(obj) if obj is not None else None


def smp_callable(api: str):
    """The object ``smp.<api>`` names, or None if it is not callable. Submodules that are not
    attributes yet (``patches.checkpoint``) are imported, as Python's import would."""
    parts = api.split(".")
    obj = importlib.import_module(SMP)
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join([SMP, *parts[:i + 1]]))
            except ImportError:
                return None
        except ImportError:  # smp.nn resolves its layers lazily; without Megatron-core there are none to read
            return None
    return obj if callable(obj) else None


def method_signature(wrapper: str, name: str) -> inspect.Signature | None:
    """Signature of a method of the wrapper class as called on an instance (no ``self``); None for
    properties, forwarded names and callables inspect cannot read."""
    cls = wrapper_class(wrapper)
    try:
        raw = inspect.getattr_static(cls, name)
    except AttributeError:
        return None
    if isinstance(raw, (staticmethod, classmethod)):
        return signature(getattr(cls, name))
    if not inspect.isfunction(raw):
        return None
    sig = signature(raw)
    return sig.replace(parameters=list(sig.parameters.values())[1:]) if sig and sig.parameters else sig


def signature(obj) -> inspect.Signature | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    # annotations are strings under `from __future__ import annotations`: left out of notes
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def call_problems(sig: inspect.Signature, positional: int | None, keywords: list[str],
                  display: str) -> list[tuple[str | None, str]]:
    """(keyword, note) for each keyword the real callable refuses with TypeError, and (None, note)
    for too many positional arguments (``positional`` None: a ``*args`` splat, not counted)."""
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    problems: list[tuple[str | None, str]] = [
        (kw, f"{display}() takes no keyword {kw!r} in smp-adapter: its parameters are {sig}")
        for kw in keywords if kw not in named and not var_kw]
    if positional:
        try:
            sig.bind_partial(*range(positional))
        except TypeError as exc:
            problems.append((None, f"{display}(): {exc} in smp-adapter: its parameters are {sig}"))
    return problems
