"""Deprecation warnings torch raises against its own code, which no script can act on.

torch 2.13's ``torch.distributed.pipelining.pipeline()`` deep-copies the traced graph's code generator,
which holds pytree ``LeafSpec`` objects; ``LeafSpec`` is deprecated, and every copy of one (rebuilt by
``copyreg``) warns ``isinstance(treespec, LeafSpec) is deprecated``: twice per pipeline rank, about code
that is torch's. The filter matches that message only where ``copyreg`` rebuilds the object, so a
script's own ``LeafSpec()`` still warns. It is installed when the pipeline engine is chosen and removed
at ``smp.shutdown()``.
"""

from __future__ import annotations

import warnings

from smp_adapter import on_shutdown

LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_COPYREG = r"copyreg\Z"  # the module the warning is attributed to when a copy rebuilds the object


def quiet_torch_pipelining() -> None:
    """Filter the LeafSpec copy warning (above); idempotent."""
    if not any(is_leafspec_filter(f) for f in warnings.filters):
        warnings.filterwarnings("ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning, module=_COPYREG)


def is_leafspec_filter(entry) -> bool:
    """Whether a warnings.filters entry is the one quiet_torch_pipelining installs."""
    _, message, category, module, _ = entry
    return (category is FutureWarning and getattr(message, "pattern", None) == LEAFSPEC_MESSAGE
            and getattr(module, "pattern", None) == _COPYREG)


@on_shutdown
def _remove() -> None:
    # an "ignore" entry leaves nothing in the warning registries, so dropping it needs no cache reset
    warnings.filters[:] = [f for f in warnings.filters if not is_leafspec_filter(f)]
