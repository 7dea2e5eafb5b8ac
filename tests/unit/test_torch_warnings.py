"""compat/torch_warnings.py: inside torch_pipelining_quiet (around torch's pipeline() calls) torch's own
LeafSpec copies do not warn, a script's own LeafSpec() still warns, and outside it, after it, the process's
filters are as they were (the copy warns again); a real pipeline() cut gives no LeafSpec warning in it."""

import copy
import warnings

import pytest
import torch

from smp_adapter.compat import torch_warnings


def _future_warnings(make, quiet: bool) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:  # restores the process's filters afterwards
        warnings.simplefilter("always")  # every warning shown, unless a filter in front of it says otherwise
        if quiet:
            before = list(warnings.filters)
            with torch_warnings.torch_pipelining_quiet():
                make()
            assert warnings.filters == before  # the filter went with the block
        else:
            make()
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def _leaf():
    from torch.utils import _pytree

    return _pytree.treespec_leaf() if hasattr(_pytree, "treespec_leaf") else _pytree.LeafSpec()


def test_only_torchs_own_leafspec_copies_are_quieted_and_only_inside_the_block():
    from torch.utils import _pytree

    leaf = _leaf()
    if not _future_warnings(lambda: copy.deepcopy(leaf), quiet=False):
        pytest.skip("this torch does not warn when a LeafSpec is copied")
    assert _future_warnings(lambda: copy.deepcopy(leaf), quiet=True) == []
    assert _future_warnings(_pytree.LeafSpec, quiet=True)  # the script's own use is attributed to it: still said
    assert _future_warnings(lambda: copy.deepcopy(leaf), quiet=False)  # after the block: said again


def test_a_pipeline_cut_is_quiet_inside_the_block():
    from torch.distributed.pipelining import SplitPoint, pipeline

    def cut():  # a model of its own each time: pipeline() leaves the split modules' forwards wrapped
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        pipeline(model, (torch.zeros(2, 4),), {}, split_spec={"2": SplitPoint.BEGINNING})

    leafspec = [m for m in _future_warnings(cut, quiet=False) if "LeafSpec" in m]
    if not leafspec:
        pytest.skip("this torch's pipeline() gives no LeafSpec warning")
    assert [m for m in _future_warnings(cut, quiet=True) if "LeafSpec" in m] == []
