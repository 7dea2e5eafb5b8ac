"""Deprecation warnings torch raises against its own code, which no script can act on.

torch 2.13's ``torch.distributed.pipelining.pipeline()`` deep-copies the traced graph's code generator,
which holds pytree ``LeafSpec`` objects; ``LeafSpec`` is deprecated, and every copy of one (rebuilt by
``copyreg``) warns ``isinstance(treespec, LeafSpec) is deprecated``: once per ``pipeline()`` call, twice per
pipeline rank, about code that is torch's. The filter holds only inside the ``pipeline()`` calls (the copies
happen there and nowhere later: not in the stages' construction, nor in the schedule's steps) and matches
that message only where ``copyreg`` rebuilds the object, so a script's own ``LeafSpec()``, in the model's
forward that torch traces or anywhere else, still warns.
"""

from __future__ import annotations

import contextlib
import warnings

LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_COPYREG = r"copyreg\Z"  # the module the warning is attributed to when a copy rebuilds the object


@contextlib.contextmanager
def torch_pipelining_quiet():
    """Around a ``pipeline()`` call: the LeafSpec copy warning (above) filtered; the process's filters
    as they were afterwards."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning, module=_COPYREG)
        yield
