"""The one wrapper of ``torch.nn.Module.__init__``: "every module created inside this context gets X".

smp v1 has two such contexts: ``smp.partition(i)`` (pipeline stage marks) and
``smp.tensor_parallelism()`` / ``smp.model_creation(tensor_parallelism=...)`` (TP marks). Each opens
``on_module_created(callback)``; while at least one is open ``nn.Module.__init__`` is wrapped, and the
original is put back when the last one closes (or on ``reset``, which ``smp.shutdown`` calls).

After the original ``__init__`` returns, the callbacks run in the order their contexts were opened,
so the innermost context's mark is written last and wins.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

from torch import nn

from smp_adapter import on_shutdown

_callbacks: list[Callable[[nn.Module], None]] = []
_lock = threading.RLock()
_original_init = None


def _init_with_callbacks(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    for callback in list(_callbacks):
        callback(self)


@contextlib.contextmanager
def on_module_created(callback: Callable[[nn.Module], None]):
    """Call ``callback(module)`` for every ``nn.Module`` constructed inside the context."""
    global _original_init
    with _lock:
        if not _callbacks:
            _original_init = nn.Module.__init__
            nn.Module.__init__ = _init_with_callbacks
        _callbacks.append(callback)
    try:
        yield
    finally:
        with _lock:
            if callback in _callbacks:
                _callbacks.remove(callback)
            if not _callbacks:
                reset()


@on_shutdown
def reset() -> None:
    """Close every context: the original ``nn.Module.__init__`` is back."""
    global _original_init
    with _lock:
        _callbacks.clear()
        if _original_init is not None:
            nn.Module.__init__ = _original_init
            _original_init = None
