"""Each pipeline rank materialises and keeps only its own stage(s) (docs/pipeline.md, "Memory").

The first step profiles, traces and cuts the model with stand-ins: every parameter and buffer of
the model (and of the pre-split tensor-parallel modules traced in place of the split ones) is
replaced, in its module, by a fake tensor of the same layout on the rank's device (a tied weight by
one stand-in), and put back afterwards; the example inputs are fakes too. The model's own tensors are never traced, so nothing of the trace holds them;
the stage modules are then pointed at them by name (tied.point_stages_at_model).

``keep_stage`` then gives the tensors of this rank's stage(s) their values on the rank's device
(moved from the host, or replayed from the creation record under delayed initialisation,
runtime/deferred_init/) and turns every other tensor of the model into a meta tensor, keeping
each Python object (the optimizer, hooks and stage modules hold them): nothing of another stage
stays allocated on the rank (tests/distributed/test_pipeline_memory.py measures it against the
kernel's resident-memory count).
"""

from __future__ import annotations

import torch
from torch import nn

from smp_adapter.runtime.deferred_init import (
    DeferredTensor, materialize_in_place, meta_like, module_tensors, release_freed_heap, replace_in_place)


class FakeStandIns:
    """Inside: the modules' parameters and buffers are stand-ins without storage (torch's FakeTensors
    on the rank's device, of one FakeTensorMode), and ``inputs(tree)`` makes the example inputs
    fakes of the same mode: the model runs and is exported as on the device, with nothing allocated.
    Hugging Face models take their traceable paths for fake tensors (is_tracing)."""

    def __init__(self, modules: list[nn.Module], device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.modules, self.device = modules, torch.device(device)
        self.mode = FakeTensorMode()
        self.saved: list = []  # (the module's parameter or buffer dict, name, the model's tensor)

    def inputs(self, tree):
        return torch.utils._pytree.tree_map(
            lambda t: self.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)

    def __enter__(self):
        stand_ins: dict[int, torch.Tensor] = {}
        seen = set()
        for root in self.modules:
            for m in root.modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                for table in (m._parameters, m._buffers):
                    for name, t in table.items():
                        if t is None:
                            continue
                        if id(t) not in stand_ins:
                            stand_ins[id(t)] = self._stand_in(t)
                        self.saved.append((table, name, t))
                        table[name] = stand_ins[id(t)]
        self._saved_deepcopy = _deepcopy_fakes_as_fakes()
        return self

    def __exit__(self, *exc):
        for table, name, t in self.saved:
            table[name] = t
        self.saved = []
        _restore_deepcopy(self._saved_deepcopy)

    def _stand_in(self, t: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        fake = FakeTensor(self.mode, meta, self.device)
        if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False):
            return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake


def _fake_deepcopy(self, memo):
    new = memo.get(id(self))
    if new is None:
        new = self.detach().clone()  # a FakeTensor's clone is a FakeTensor of its mode: no storage copied
        if getattr(self, "_is_param", False):  # nn.Parameter(fake) is the fake itself, flagged
            new = nn.Parameter(new, requires_grad=self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
    return new


def _deepcopy_fakes_as_fakes():
    """torch's pipeline() deep-copies the parameters two stages share (a tied embedding). Tensor's own
    __deepcopy__ copies a subclass's storage unless its data_ptr() is 0, which a FakeTensor need not
    report: it then copies bytes from an address that holds none (seen as heap corruption and SIGSEGV
    with GPT-Neo's tied embedding). While stand-ins are in place a FakeTensor is copied as a fake clone
    (the copies are replaced by the model's own tensors afterwards: tied.point_stages_at_model)."""
    from torch._subclasses.fake_tensor import FakeTensor

    saved = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = _fake_deepcopy
    return saved


def _restore_deepcopy(saved) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    if saved is None:
        del FakeTensor.__deepcopy__
    else:
        FakeTensor.__deepcopy__ = saved


def keep_stage(model: nn.Module, stage_tensors: list[torch.Tensor], record, device) -> None:
    """``stage_tensors`` (this rank's) get their values on ``device``; every other tensor of
    ``model`` becomes meta (its values released), each object keeping its identity."""
    mine = {id(t) for t in stage_tensors}
    with torch.no_grad():
        deferred = []
        for t in stage_tensors:
            if isinstance(t, DeferredTensor):
                deferred.append(t)
            elif not t.is_meta and t.device != torch.device(device):
                replace_in_place(t, t.detach().to(device))
        if deferred:
            materialize_in_place(record, deferred, device)
        for t in module_tensors(model):
            if id(t) not in mine and not t.is_meta:
                replace_in_place(t, meta_like(t))  # a delayed one stays replayable (same record storage)
    release_freed_heap()  # the other stages' values, and what tracing allocated


def stage_tensors(stage_modules) -> list[torch.Tensor]:
    seen, out = set(), []
    for m in stage_modules:
        for t in module_tensors(m):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out
