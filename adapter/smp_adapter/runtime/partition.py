"""Manual pipeline-stage marking: ``smp.partition(i)`` and ``smp.set_partition(module, i)``.

The marks are recorded on the module instances (``partition_mark`` reads them). With ``auto_partition: true`` (the default) they
are ignored, whatever the pipeline degree, so a pipeline script runs at pp = 1 for debugging; with
``auto_partition: false`` an index must be below the pipeline degree. With pp > 1 and
``auto_partition: false`` the pipeline engine (runtime.engines.pipeline.partition.manual_split) turns
them into stages at the first step; under auto-partitioning they are ignored with a warning.
"""

from __future__ import annotations

import contextlib

from torch import nn

from smp_adapter.errors import SMPUsageError
from smp_adapter.module_init_hooks import on_module_created
from smp_adapter.runtime.state import require_initialized

PARTITION_ATTR = "_smp_partition"  # on the module instance


def _check_index(index, api: str) -> int:
    s = require_initialized(api)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SMPUsageError(f"smp.{api}({index!r}): the partition index must be an integer >= 0 (a pipeline stage)")
    problem = s.dims.stage_index_problem(index)
    if problem:
        raise SMPUsageError(f"smp.{api}({index!r}): {problem}")
    return index


@contextlib.contextmanager
def partition(index: int):
    """Modules created inside go to stage ``index`` (innermost context wins)."""
    index = _check_index(index, "partition")
    with on_module_created(lambda module: set_partition_mark(module, index)):
        yield


def set_partition(module: nn.Module, partition: int) -> None:
    if not isinstance(module, nn.Module):
        raise SMPUsageError(f"smp.set_partition takes an nn.Module, got {type(module).__name__}")
    set_partition_mark(module, _check_index(partition, "set_partition"))


def set_partition_mark(module: nn.Module, index: int) -> None:
    module.__dict__[PARTITION_ATTR] = index


def partition_mark(module: nn.Module):
    """The stage a module was marked for, or None (runtime/engines/pipeline/partition.py reads the marks)."""
    return module.__dict__.get(PARTITION_ATTR)
