"""``smdistributed.modelparallel.test.torch.utils``: smp v1's debugging helpers that the AWS BERT
example imports. ``dump_model`` records this rank's local parameters, gradients, output and loss at a
batch; ``verify`` compares the current ones with such a record (e.g. from a run with another layout
or a single process) and raises ``AssertionError`` naming the first entry that differs."""

from __future__ import annotations

import torch

from smp_adapter.runtime.state import state

__all__ = ["dump_model", "verify"]


def _record(model, output, loss) -> dict:
    named = model.local_named_parameters() if hasattr(model, "local_named_parameters") else model.named_parameters()
    params, grads = {}, {}
    for name, p in named:
        params[name] = p.detach().float().cpu().clone()
        if p.grad is not None:
            grads[name] = p.grad.detach().float().cpu().clone()

    def plain(x):
        if isinstance(x, torch.Tensor):
            return x.detach().float().cpu().clone()
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if hasattr(x, "outputs"):  # a StepOutput
            return [plain(v) for v in x.outputs]
        return x

    return {"params": params, "grads": grads, "output": plain(output), "loss": plain(loss)}


def _path(batch_idx, identifier) -> str:
    return f"{identifier}_{batch_idx}_rank{state.rank}.pt"


def dump_model(model, batch_idx, identifier, output=None, loss=None) -> str:
    """Save the record to ``<identifier>_<batch_idx>_rank<R>.pt``; returns the path."""
    path = _path(batch_idx, identifier)
    torch.save(_record(model, output, loss), path)
    return path


def verify(model, batch_idx, identifier, output=None, loss=None, rtol=1e-5, atol=1e-6) -> None:
    """Compare weights, gradients, output and loss with the record ``dump_model`` wrote."""
    saved = torch.load(_path(batch_idx, identifier), weights_only=True)
    now = _record(model, output, loss)
    for part in ("params", "grads"):
        missing = sorted(set(saved[part]) ^ set(now[part]))
        if missing:
            raise AssertionError(f"verify({identifier}, batch {batch_idx}): {part} differ in names: {missing[:5]}")
        for name, ref in saved[part].items():
            torch.testing.assert_close(now[part][name], ref, rtol=rtol, atol=atol, msg=lambda m: f"{part} {name}: {m}")
    for part in ("output", "loss"):
        if saved[part] is not None and now[part] is not None:
            torch.testing.assert_close(now[part], saved[part], rtol=rtol, atol=atol, msg=lambda m: f"{part}: {m}")
