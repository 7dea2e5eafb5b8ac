"""What torch.distributed.pipelining does differently in the older torch releases of the supported range
(README "Supported versions"): every version guard of the pipeline engine lives here.

The code elsewhere is written against the newest torch's pipelining; each function below makes an
older release behave the same, or refuses what it lacks with UnsupportedFeatureError naming the torch
that has it. Facts, each measured on that release with the CUDA wheel on CPU/gloo (2.8 is outside
the range: its torch.export unflattening cannot cut an nn.Sequential, "Child module ... is not a
descendant of parent module", so no pipeline at all runs there):

* torch < 2.12: a traced stage sets up its activation buffers once (``_configure_outputs_meta``
  refuses a second configuration: "Attempting to reconfigure output_meta"), so a stage used by a
  second schedule (training, then evaluation) must forget its first output metadata
  (``forget_output_meta``).
* torch < 2.13: the traced stage's ``create_recv_tensor`` calls ``requires_grad_(True)`` on every
  receive buffer of a training schedule, which fails for an integer or boolean value a stage
  receives (token ids, a mask: "only Tensors of floating point dtype can require gradients");
  ``receive_integers`` makes such buffers without a gradient, as newer torch does; and in the
  backward it expects a gradient for every received value ("has gradients None and is expecting to
  send gradients to stage 0"), so the receiving stage sends zeros of the value's dtype for them (the
  sending stage's backward skips an output without gradient, as it does on newer torch).
* torch < 2.13: the split backward of the zero-bubble schedules (zero_bubble, zbv, dualpipev:
  torch's stage_backward_input / stage_backward_weight) gives a weight used twice inside one stage
  a wrong gradient (pytorch #180952), and surgery.merge_weight_groups, which corrects it, works on
  2.13's weight step only: on 2.11 and 2.12 the tied "sixtied" model's losses differ from one
  process under zero_bubble and zbv (tests/distributed/test_pipeline_schedules.py), and the
  split-backward pass-through unit test fails. These schedules are refused there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import torch

from smp_adapter.errors import UnsupportedFeatureError


@functools.lru_cache(maxsize=None)
def torch_release() -> tuple[int, int]:
    """(major, minor) of the running torch ("2.11.0+cu130" -> (2, 11))."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def older_than(major: int, minor: int) -> bool:
    return torch_release() < (major, minor)


# The schedules that need a torch newer than the range's floor, and the release they need (see above)
SCHEDULE_MIN_TORCH: dict[str, tuple[int, int]] = {"zero_bubble": (2, 13), "zbv": (2, 13), "dualpipev": (2, 13)}


def check_schedule(schedule: str) -> None:
    """Refuse ``pipeline: <schedule>`` on a torch that lacks it or runs it wrongly."""
    need = SCHEDULE_MIN_TORCH.get(schedule)
    if need is not None and older_than(*need):
        raise UnsupportedFeatureError(
            f"pipeline: {schedule} needs torch >= {need[0]}.{need[1]} (this is torch {torch.__version__}, whose "
            "split backward gives a weight used twice inside a stage a wrong gradient, pytorch #180952); "
            "install a newer torch, or use pipeline: interleaved, simple or interleaved_1f1b")


def forget_output_meta(stage) -> None:
    """Let ``stage`` set up its buffers again for another schedule (torch < 2.12 keeps its first ones)."""
    if hasattr(stage, "_outputs_meta"):
        stage._outputs_meta = None


def receive_integers(stage) -> None:
    """Make ``stage``'s receive buffers of integer or boolean values without a gradient (torch < 2.13)."""
    if not older_than(2, 13) or not hasattr(stage, "_create_act_recv_info"):
        return
    original = stage._create_act_recv_info

    def _create_act_recv_info(self):
        wants_grad, self.has_backward = self.has_backward, False  # no requires_grad_ inside torch's loop
        try:
            infos = original()
        finally:
            self.has_backward = wants_grad
        if wants_grad:
            for info in infos:
                if isinstance(getattr(info, "buffer", None), torch.Tensor) and not _without_gradient(info):
                    info.buffer.requires_grad_(True)
                    if getattr(info, "tensor_meta", None) is not None:  # 2.12 records it (a frozen dataclass)
                        info.tensor_meta = dataclasses.replace(info.tensor_meta, requires_grad=True)
        return infos

    stage._create_act_recv_info = types.MethodType(_create_act_recv_info, stage)
    send_gradients = stage.get_bwd_send_ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        grads, infos = self.bwd_cache.get(bwd_chunk_id), self.args_recv_info.get(bwd_chunk_id)
        if grads is not None and infos is not None:
            self.bwd_cache[bwd_chunk_id] = tuple(
                torch.zeros_like(info.buffer) if grad is None and _without_gradient(info) else grad
                for grad, info in zip(grads, infos))
        return send_gradients(bwd_chunk_id)

    stage.get_bwd_send_ops = types.MethodType(get_bwd_send_ops, stage)


def _without_gradient(info) -> bool:
    buffer = getattr(info, "buffer", None)
    return isinstance(buffer, torch.Tensor) and not (buffer.is_floating_point() or buffer.is_complex())


@contextlib.contextmanager
def compiling_state():
    """Inside: the model sees what it sees under torch.export (``torch.compiler.is_compiling()`` and
    ``is_exporting()`` true), for the engine's own passes over it (the profiling forward on fake
    tensors). Models choose traceable paths by that state: transformers 4.x's SDPA mask preparation
    skips its data-dependent ``torch.all(mask == 1)`` only while compiling, which a fake tensor cannot
    answer (DataDependentOutputException). torch.export sets the same two flags
    (torch._export.utils._compiling_state_context, 2.11-2.14)."""
    import torch.compiler as compiler

    saved = compiler._is_compiling_flag, compiler._is_exporting_flag
    compiler._is_compiling_flag = compiler._is_exporting_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag, compiler._is_exporting_flag = saved
