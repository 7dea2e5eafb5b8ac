"""apex's multi-tensor kernels (``amp_C``), its ``multi_tensor_applier`` and ``apex_C``'s flatten,
in plain PyTorch (``torch._foreach_*``), with apex's semantics:

* ``multi_tensor_scale(chunk, flag, [ins, outs], scale)``: ``out = float(in) * scale`` stored in
  ``out``'s dtype (in place when ``out is in``); ``flag`` becomes 1 when any *input* element is inf
  or NaN (apex checks the inputs, not the scaled results). Returns None.
* ``multi_tensor_axpby(chunk, flag, [xs, ys, outs], a, b, arg_to_check)``: ``out = a*float(x) +
  b*float(y)``; ``flag`` is set by a non-finite x and y (``arg_to_check`` -1), x only (0) or y only (1).
* ``multi_tensor_l2norm(chunk, flag, [tensors], per_tensor=False)``: ``(norm, per_tensor_norms)``, both
  float32 on the tensors' device: ``norm`` has shape ``[1]``; ``per_tensor_norms`` shape
  ``[len(tensors)]`` with ``per_tensor``, else ``[0]``. Squares are summed in float32 as apex does, so a
  norm beyond float32's range is inf; ``flag`` becomes 1 when a tensor's sum of squares is inf or NaN.
* ``flag`` is written on its device without a host synchronisation (``masked_fill_``), as apex's
  kernels write it; it is never cleared (callers zero it, as with apex).
* Lists: as many lists as the kernel has operands, each as long as the first, matching sizes. Empty
  lists are a no-op (``l2norm`` returns zero norms on ``flag``'s device); apex requires them non-empty.
* dtypes: float32, float16, bfloat16, as apex's kernels dispatch (``axpby``: float32, float16).

``chunk_size`` only sizes apex's CUDA launches; results do not depend on it.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp_adapter.errors import SMPUsageError

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _checked(name: str, tensor_lists, depth: int, dtypes=_FLOATS) -> list[list[torch.Tensor]]:
    if not isinstance(tensor_lists, (list, tuple)) or len(tensor_lists) != depth:
        raise SMPUsageError(f"amp_C.{name}: tensor_lists must hold {depth} list(s) of tensors, got "
                            f"{len(tensor_lists) if isinstance(tensor_lists, (list, tuple)) else type(tensor_lists).__name__}")
    lists = [list(ts) for ts in tensor_lists]
    first = lists[0]
    for ts in lists:
        if len(ts) != len(first):
            raise SMPUsageError(f"amp_C.{name}: size mismatch among tensor lists ({[len(t) for t in lists]}): give "
                                "every list one tensor per position")
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise SMPUsageError(f"amp_C.{name}: expected tensors, got {type(t).__name__} at position {i}")
            if t.dtype not in dtypes:
                raise SMPUsageError(f"amp_C.{name}: dtype {t.dtype} is not supported (apex's kernel takes "
                                    f"{', '.join(str(d) for d in dtypes)})")
            if t.numel() != first[i].numel() or t.device != first[0].device:
                raise SMPUsageError(f"amp_C.{name}: tensor {i} differs in size or device from the first list's: "
                                    "apex applies the kernel element by element across the lists")
    return lists


def _flag_non_finite(noop_flag: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Set ``noop_flag`` to 1 when any element of ``tensors`` is inf or NaN. The max-abs norm of a
    tensor is inf or NaN exactly then (it never overflows: no squares), one fused pass per list."""
    if not tensors:
        return
    peaks = torch._foreach_norm(tensors, float("inf"))
    bad = ~torch.isfinite(torch.stack([p.float() for p in peaks])).all()
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float) -> None:
    ins, outs = _checked("multi_tensor_scale", tensor_lists, 2)
    if not ins:
        return
    _flag_non_finite(noop_flag, ins)
    scale = float(torch.tensor(scale, dtype=torch.float32))  # apex's kernel argument is a C float
    # float32 in place (the common case: gradients unscaled or clipped where they are) needs no copy;
    # everything else is multiplied in float32 and rounded once into the output, as apex's kernel does
    same = {i for i, (a, b) in enumerate(zip(ins, outs)) if a is b and a.dtype == torch.float32}
    if same:
        torch._foreach_mul_([ins[i] for i in sorted(same)], scale)
    rest = [i for i in range(len(ins)) if i not in same]
    if rest:
        scaled = torch._foreach_mul([ins[i].float() for i in rest], scale)
        torch._foreach_copy_([outs[i] for i in rest], scaled)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                       arg_to_check: int) -> None:
    xs, ys, outs = _checked("multi_tensor_axpby", tensor_lists, 3, dtypes=(torch.float32, torch.float16))
    if not xs:
        return
    checked = {-1: xs + ys, 0: xs, 1: ys}.get(int(arg_to_check), [])
    _flag_non_finite(noop_flag, checked)
    result = torch._foreach_mul([x.float() for x in xs], float(a))
    torch._foreach_add_(result, torch._foreach_mul([y.float() for y in ys], float(b)))
    torch._foreach_copy_(outs, result)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, per_tensor: bool | None = False):
    (tensors,) = _checked("multi_tensor_l2norm", tensor_lists, 1)
    if not tensors:
        device = noop_flag.device
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(1, dtype=torch.float32, device=device), empty
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    squares = norms * norms  # float32: overflows to inf where apex's float32 sums do
    noop_flag.masked_fill_((~torch.isfinite(squares).all()).to(noop_flag.device), 1)
    total = squares.sum().sqrt().reshape(1)
    per = squares.sqrt() if per_tensor else torch.zeros(0, dtype=torch.float32, device=total.device)
    return total, per


class MultiTensorApply:
    """``apex.multi_tensor_apply.MultiTensorApply``: ``applier(op, flag, lists, *args)`` calls
    ``op(chunk_size, flag, lists, *args)``. ``available`` is True: the ops above need no extension."""

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        return None

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


def flatten(tensors):
    """``apex_C.flatten``: one contiguous tensor holding ``tensors`` back to back."""
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat, tensors):
    """``apex_C.unflatten``: views of ``flat`` shaped like ``tensors`` (writes go to ``flat``)."""
    return _unflatten_dense_tensors(flat, list(tensors))
