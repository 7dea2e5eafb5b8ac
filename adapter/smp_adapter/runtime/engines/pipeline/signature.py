"""The signature of a call's model inputs: what the traced stages depend on (docs/pipeline.md, "Other inputs").

torch.export specialises a stage graph on the inputs it was traced with: which arguments are given (a Hugging
Face model traced with ``labels`` computes a loss that a call without them cannot feed), their shapes (the
graph's reshapes, and torch's receive buffers, are sized from the traced shapes), the values of non-tensor
arguments (``return_dict``, ``output_hidden_states``), and the module mode (dropout, batch norm). So the
pipeline keeps one set of stages per signature (runtime.py), all cut at the first step's modules over the same
tensors. Only the first stage sees the inputs; ``agree`` tells the other ranks which set this step runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp_adapter.errors import UnsupportedFeatureError

NEW = -1  # the first stage met inputs of a signature not traced yet: every rank traces them
_MIXED = -2  # the microbatches of one step differ: refused on every rank
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _leaf(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    # an object's repr may hold its address (a new key at every call): its type is what the trace sees
    return (type(value).__qualname__,)


def of_inputs(args, kwargs, training: bool):
    """The signature of one microbatch's model inputs (hashable; keyword order does not count)."""
    tree = torch.utils._pytree
    leaves, spec = tree.tree_flatten((tuple(args), sorted(kwargs.items())))
    return (training, str(spec), tuple(_leaf(v) for v in leaves))


def of_microbatches(inputs: list, module) -> tuple | str:
    """The signature shared by every microbatch of the step, or "mixed" when they differ."""
    keys = {of_inputs(args, kwargs, module.training) for args, kwargs in inputs}
    return next(iter(keys)) if len(keys) == 1 else "mixed"


def agree(known: list, key, group, is_first: bool, device) -> int:
    """On every rank of the PP group: the index in ``known`` (the first stage's list of signatures met, in
    the order every rank built them) of this step's signature, or NEW. One int64 broadcast per step."""
    value = 0
    if is_first:
        value = _MIXED if key == "mixed" else (known.index(key) if key in known else NEW)
    index = torch.tensor([value], dtype=torch.int64, device=device)  # the rank's device: NCCL takes no CPU tensor
    dist.broadcast(index, src=dist.get_global_rank(group, 0), group=group)
    if int(index) == _MIXED:
        raise UnsupportedFeatureError(
            "pipeline parallelism: the microbatches of this step give the model inputs of different shapes or "
            "keywords, and one schedule runs one traced graph for all of them: give every microbatch the same "
            "shapes (a batch size divisible by microbatches, sequences padded to one length)")
    return int(index)
