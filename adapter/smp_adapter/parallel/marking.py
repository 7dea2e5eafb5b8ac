"""Marking modules for tensor parallelism (smp.tensor_parallelism, smp.set_tensor_parallelism): pure bookkeeping, no process group.

A mark is stored on the module instance as ``module._smp_tp_mark = TPMark(enabled, kwargs)``.

* ``tensor_parallelism(enabled, **kwargs)``: every module *created* inside the context gets the mark of
  the innermost open context (``torch.nn.Module.__init__`` is wrapped while a context is open, so a
  module is tagged before its children are built; children therefore carry their own marks).
* ``set_tensor_parallelism(module, enabled, **kwargs)``: marks ``module`` and its whole subtree (later
  calls overwrite earlier ones; disabling thus applies to the whole subtree, as the spec says).
* ``tp_register`` / ``tp_register_with_module``: register a ``DistributedModule`` subclass as the TP
  replacement of a class. The original ``__init__`` arguments of instances are recorded so the
  distributed module can be built from them. With smp v1's own Hugging Face hooks
  (``smp.nn.huggingface.<family>.get_hf_*_hooks()``, hf_hooks.py) nothing is registered: the class keeps
  its in-place split.

Which marked modules are actually split is decided later by ``tensor.apply_tensor_parallelism``:
only supported classes, only the outermost marked supported module of a subtree.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.nn as nn

from smp_adapter import on_shutdown
from smp_adapter.errors import SMPUsageError
from smp_adapter.module_init_hooks import on_module_created
from smp_adapter.parallel.hf_hooks import SPLIT_IN_PLACE  # smp v1's own Hugging Face hooks: keep the in-place split
from smp_adapter.parallel.context import DistributedModule

_MARK_ATTR = "_smp_tp_mark"
_INIT_ARGS_ATTR = "_smp_tp_init_args"


@dataclass(frozen=True)
class TPMark:
    enabled: bool
    kwargs: dict = field(default_factory=dict)


def get_mark(module: nn.Module) -> Optional[TPMark]:
    """The module's own TP mark, or None when it was never marked."""
    return module.__dict__.get(_MARK_ATTR)


def _set_mark(module: nn.Module, mark: TPMark) -> None:
    object.__setattr__(module, _MARK_ATTR, mark)


# ---------------------------------------------------------------- context manager

_stack: list[TPMark] = []  # open contexts' marks, innermost last (current_mark)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs):
    """Mark supported modules created inside for tensor parallelism (innermost context wins).

    ``kwargs`` override matching ``__init__`` arguments of the substituted distributed module.
    """
    from smp_adapter.compat.hf_skipped_init import transformers_init_weights

    mark = TPMark(bool(enabled), dict(kwargs))
    _stack.append(mark)
    try:
        # a template's `PreTrainedModel.init_weights = lambda x: None` counted on smp's modules drawing the
        # weights: ours are transformers' own, so its init runs (compat/hf_skipped_init.py)
        with on_module_created(lambda module: _set_mark(module, mark)), \
                (transformers_init_weights() if enabled else contextlib.nullcontext()):
            yield
    finally:
        if _stack and _stack[-1] is mark:  # (reset() may have cleared the stack already)
            _stack.pop()


def marking_context(enabled: bool = True, **kwargs):
    """The context manager ``model_creation(tensor_parallelism=...)`` combines with its dtype and
    delayed-initialisation contexts; same as ``tensor_parallelism``. ``model_creation`` ignores
    ``tensor_parallel_config`` when TP is off, so callers pass ``enabled=False`` without kwargs then."""
    return tensor_parallelism(enabled, **kwargs)


@on_shutdown
def reset() -> None:
    """Forget open contexts (smp.shutdown); registrations stay (they belong to classes)."""
    _stack.clear()


def current_mark() -> Optional[TPMark]:
    """The mark a module created right now would get (None outside any context)."""
    return _stack[-1] if _stack else None


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs) -> None:
    """Mark ``module`` and its whole subtree after creation (call before ``DistributedModel``)."""
    if not isinstance(module, nn.Module):
        raise SMPUsageError(
            f"smp.set_tensor_parallelism expects a torch.nn.Module, got {type(module).__name__}"
        )
    if getattr(module, "_smp_tp_applied", False):
        raise SMPUsageError(
            "smp.set_tensor_parallelism was called after smp.DistributedModel split the model; "
            "mark modules before wrapping the model"
        )
    mark = TPMark(bool(enabled), dict(kwargs))
    for m in module.modules():
        _set_mark(m, mark)


# ---------------------------------------------------------------- registry (tp_register)


@dataclass(frozen=True)
class Registration:
    dist_module: type
    init_hook: Optional[Callable] = None
    forward_hook: Optional[Callable] = None
    return_hook: Optional[Callable] = None


_registry: dict[type, Registration] = {}


def registration_for(module: nn.Module) -> Optional[Registration]:
    """The registration of the module's class (or of its closest registered base class)."""
    for cls in type(module).__mro__:
        reg = _registry.get(cls)
        if reg is not None:
            return reg
    return None


def recorded_init_args(module: nn.Module):
    """``(args, kwargs)`` the module's ``__init__`` was called with, if its class was registered
    before the instance was created; else None."""
    return module.__dict__.get(_INIT_ARGS_ATTR)


def _signature_params(fn, drop_self: bool):
    params = list(inspect.signature(fn).parameters.values())
    if drop_self and params:
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


def _check_hook(hook, original, what: str, cls: type) -> None:
    if hook is None:
        return
    if not callable(hook):
        raise SMPUsageError(f"tp_register: {what} for {cls.__name__} must be callable")
    want = _signature_params(original, drop_self=True)
    got = _signature_params(hook, drop_self=False)
    if want != got:
        fmt = lambda ps: "(" + ", ".join(n for n, _, _ in ps) + ")"  # noqa: E731
        raise SMPUsageError(
            f"tp_register: the signature of {what} {fmt(got)} must exactly match "
            f"{cls.__name__}.{'__init__' if what == 'init_hook' else 'forward'} without self {fmt(want)}"
        )


def _record_init_args(cls: type) -> None:
    """Wrap ``cls.__init__`` (once) so instances remember their constructor arguments."""
    own = cls.__dict__.get("__init__")
    if own is not None and getattr(own, "_smp_records_args", False):
        return
    init = cls.__init__  # own or inherited

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if _INIT_ARGS_ATTR not in self.__dict__:  # outermost registered class records
            object.__setattr__(self, _INIT_ARGS_ATTR, (args, dict(kwargs)))
        init(self, *args, **kwargs)

    __init__._smp_records_args = True
    cls.__init__ = __init__


def tp_register_with_module(
    module_cls: type,
    dist_module: type,
    init_hook: Optional[Callable] = None,
    forward_hook: Optional[Callable] = None,
    return_hook: Optional[Callable] = None,
) -> None:
    """Register ``dist_module`` (a ``smp.nn.DistributedModule`` subclass) as the TP replacement of
    ``module_cls``. ``init_hook(*init_args) -> (args, kwargs)`` for ``dist_module.__init__`` (return
    None to leave that instance whole); ``forward_hook(*forward_args) -> (args, kwargs)`` for its
    forward; ``return_hook(output)`` maps the distributed output to what the original returns."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise SMPUsageError(f"tp_register: {module_cls!r} is not a torch.nn.Module subclass")
    if not (isinstance(dist_module, type) and issubclass(dist_module, DistributedModule)):
        raise SMPUsageError(
            f"tp_register: {getattr(dist_module, '__name__', dist_module)!r} must be a subclass of "
            "smp.nn.DistributedModule"
        )
    _check_hook(init_hook, module_cls.__init__, "init_hook", module_cls)
    _check_hook(forward_hook, module_cls.forward, "forward_hook", module_cls)
    if return_hook is not None and not callable(return_hook):
        raise SMPUsageError(f"tp_register: return_hook for {module_cls.__name__} must be callable")
    if getattr(init_hook, SPLIT_IN_PLACE, None) is not None:  # smp v1's own hooks for a Hugging Face class:
        _registry.pop(module_cls, None)  # its in-place split (hf.py) stays the rule, nothing is rebuilt
        return
    _record_init_args(module_cls)
    _registry[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)


def tp_register(
    dist_module: type,
    init_hook: Optional[Callable] = None,
    forward_hook: Optional[Callable] = None,
    return_hook: Optional[Callable] = None,
):
    """Class decorator form of ``tp_register_with_module``."""

    def decorate(cls):
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return decorate


def unregister(module_cls: type) -> None:
    """Remove a registration (tests)."""
    _registry.pop(module_cls, None)


def filter_init_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of mark kwargs that ``cls.__init__`` accepts (smp v1: kwargs override *matching*
    ``__init__`` arguments; the others, e.g. ``fused_softmax`` for a linear layer, do not apply)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}
