"""``smdistributed.modelparallel.torch.utils``: the helpers the public AWS scripts import from it."""

from smp_adapter.runtime.state import state as _state

__all__ = ["get_distribution_axis", "rmsg"]


def rmsg(msg) -> str:
    """The message prefixed with this process's global rank, as smp v1 logged: ``[3] msg``."""
    return f"[{_state.rank}] {msg}"


def get_distribution_axis(obj):
    """The axis along which a tensor-parallel parameter is split across the TP ranks, in the
    parameter's own (stored) orientation; None for a parameter that is not split."""
    from smp_adapter.parallel.layers import LAYOUT_ATTR

    layout = getattr(obj, LAYOUT_ATTR, None)
    if layout is None:
        return None
    return obj.dim() - 1 - layout.dim if layout.transposed else layout.dim
