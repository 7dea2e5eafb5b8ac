"""The ZeRO-3 optimizer step reads each sub group's gradients in place (runtime/engines/deepspeed/zero3.py
step_on_gradient_partitions_in_place): DeepSpeed 0.19.8 flattened them into a copy every step, a second
copy of the rank's gradient partition at the run's peak (RESULTS.md §18.2). Checked on a stand-in for
DeepSpeed's optimizer: the view is taken only where the gradients lie end to end in one buffer, in order,
of the master's dtype; anything else goes to DeepSpeed's own method."""

import torch

from smp_adapter.runtime.engines.deepspeed.zero3 import consecutive_view, step_on_gradient_partitions_in_place


class _Stage3:
    """What DeepSpeed's stage-3 optimizer keeps that the step's preparation reads."""

    def __init__(self, grads, master):
        self.averaged_gradients = [grads]
        self.fp32_partitioned_groups_flat = [master]
        self.flattened = 0

    def _prepare_fp32_grad_for_sub_group(self, sub_group_id):  # DeepSpeed's: a flattened copy
        self.flattened += 1
        master = self.fp32_partitioned_groups_flat[sub_group_id]
        master.grad = torch.cat([g.reshape(-1) for g in self.averaged_gradients[sub_group_id]]).to(master.dtype)
        self.averaged_gradients[sub_group_id] = None


def test_consecutive_views_of_one_buffer_become_one_view():
    buffer = torch.arange(10.0)
    view = consecutive_view([buffer.narrow(0, 2, 3), buffer.narrow(0, 5, 4)], torch.float32)
    assert view.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_gaps_other_orders_storages_or_dtypes_are_not_views():
    buffer = torch.arange(10.0)
    a, b = buffer.narrow(0, 0, 3), buffer.narrow(0, 4, 3)
    assert consecutive_view([a, b], torch.float32) is None  # a gap
    assert consecutive_view([buffer.narrow(0, 3, 3), a], torch.float32) is None  # out of order
    assert consecutive_view([a, torch.zeros(3)], torch.float32) is None  # another storage
    assert consecutive_view([a], torch.float64) is None
    assert consecutive_view([], torch.float32) is None


def test_the_step_reads_the_reduced_gradients_in_place_with_the_same_values():
    buffer = torch.randn(12)
    grads = [buffer.narrow(0, 0, 8).view(2, 4), buffer.narrow(0, 8, 4)]
    optimizer = _Stage3(grads, torch.zeros(12))
    step_on_gradient_partitions_in_place(optimizer)
    optimizer._prepare_fp32_grad_for_sub_group(0)
    grad = optimizer.fp32_partitioned_groups_flat[0].grad
    assert optimizer.flattened == 0 and torch.equal(grad, buffer)
    assert grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert optimizer.averaged_gradients[0] is None


def test_anything_else_takes_deepspeeds_path():
    buffer = torch.randn(12)
    longer = _Stage3([buffer.narrow(0, 0, 10)], torch.zeros(12))  # the master is longer (alignment)
    step_on_gradient_partitions_in_place(longer)
    try:
        longer._prepare_fp32_grad_for_sub_group(0)
    except RuntimeError:  # the stand-in's copy does not fit either: DeepSpeed asserts there
        pass
    assert longer.flattened == 1
    separate = _Stage3([torch.randn(6), torch.randn(6)], torch.zeros(12))
    step_on_gradient_partitions_in_place(separate)
    separate._prepare_fp32_grad_for_sub_group(0)
    assert separate.flattened == 1 and separate.fp32_partitioned_groups_flat[0].grad.shape == (12,)
    half = _Stage3([buffer.half().narrow(0, 0, 12)], torch.zeros(12))  # fp16 gradients, fp32 master
    step_on_gradient_partitions_in_place(half)
    half._prepare_fp32_grad_for_sub_group(0)
    assert half.flattened == 1
