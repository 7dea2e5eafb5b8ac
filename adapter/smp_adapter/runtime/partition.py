"""Manual pipeline-stage marking: ``smp.partition(i)`` and ``smp.set_partition(module, i)``.

The marks are recorded (``module._smp_partition``). With ``auto_partition: true`` (the default) they
are ignored, whatever the pipeline degree, so a pipeline script runs at pp = 1 for debugging; with
``auto_partition: false`` an index must be below the pipeline degree. With pp > 1 and
``auto_partition: false`` the pipeline package (smp_adapter.pipeline.partition.manual_split) turns
them into stages at the first step; under auto-partitioning they are ignored with a warning.
"""

from __future__ import annotations

import contextlib

from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.runtime.state import require_initialized

_stack: list[int] = []


def _check_index(index, api: str) -> int:
    s = require_initialized(api)
    pp = s.dims.pp
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SMPUsageError(f"smp.{api}({index!r}): the partition index must be an integer >= 0 (a pipeline stage)")
    # Under auto_partition the marks are ignored (spec §2.2), so a pipeline script can be debugged
    # at pipeline_parallel_degree 1 unchanged; the range matters only when the marks are used.
    if not s.cfg.auto_partition and index >= pp:
        raise SMPUsageError(f"smp.{api}({index!r}): the partition index must be between 0 and "
                            f"pipeline_parallel_degree - 1 = {pp - 1} (auto_partition is false, so the marks place "
                            "modules): use a smaller index or raise pipeline_parallel_degree")
    return index


@contextlib.contextmanager
def partition(index: int):
    """Modules created inside go to stage ``index`` (innermost context wins)."""
    _stack.append(_check_index(index, "partition"))
    original_init = nn.Module.__init__

    def marking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if _stack:
            self._smp_partition = _stack[-1]

    nn.Module.__init__ = marking_init
    try:
        yield
    finally:
        nn.Module.__init__ = original_init
        _stack.pop()


def set_partition(module: nn.Module, partition: int) -> None:
    if not isinstance(module, nn.Module):
        raise SMPUsageError(f"smp.set_partition takes an nn.Module, got {type(module).__name__}")
    module._smp_partition = _check_index(partition, "set_partition")
