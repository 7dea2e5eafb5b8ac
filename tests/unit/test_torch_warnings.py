"""compat/torch_warnings.py: torch pipelining's LeafSpec copies stop warning once the pipeline engine is
chosen, a script's own LeafSpec() still warns, and smp.shutdown() takes the filter away."""

import copy
import warnings

import pytest

from smp_adapter import run_shutdown_resets
from smp_adapter.compat import torch_warnings


def _future_warnings(make, quiet: bool = False, then_shutdown: bool = False) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:  # restores the process's filters afterwards
        warnings.simplefilter("always")  # every warning shown, unless a filter in front of it says otherwise
        if quiet:
            torch_warnings.quiet_torch_pipelining()
            torch_warnings.quiet_torch_pipelining()  # idempotent: still one filter
            assert sum(torch_warnings.is_leafspec_filter(f) for f in warnings.filters) == 1
        if then_shutdown:
            run_shutdown_resets()
        make()
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_only_torchs_own_leafspec_copies_are_quieted():
    from torch.utils import _pytree

    leaf = _pytree.treespec_leaf() if hasattr(_pytree, "treespec_leaf") else _pytree.LeafSpec()
    if not _future_warnings(lambda: copy.deepcopy(leaf)):
        pytest.skip("this torch does not warn when a LeafSpec is copied")
    assert _future_warnings(lambda: copy.deepcopy(leaf), quiet=True) == []
    assert _future_warnings(_pytree.LeafSpec, quiet=True)  # the script's own use is attributed to it: still said
    assert _future_warnings(lambda: copy.deepcopy(leaf), quiet=True, then_shutdown=True)  # shutdown removed it
