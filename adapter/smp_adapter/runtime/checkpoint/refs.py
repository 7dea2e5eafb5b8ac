"""Point into the engine's own checkpoint files instead of writing their bytes a second time.

The layout-independent index (runtime/checkpoint/universal.py) needs, for every parameter, its
fp32 master and optimizer-state values as they sit on this rank. DeepSpeed has just written exactly
those tensors (ZeRO flat partitions, the torch optimizer's state, the module's parameters) into its
own files. ``SavedTensors`` captures what DeepSpeed's checkpoint engine saves during a ``with`` block
and then answers, for a tensor view on this rank, "which file, which object path, which offset"
holds it: pure pointer arithmetic over the same live storage DeepSpeed serialized, so nothing
depends on the layout of DeepSpeed's state dicts, and a DeepSpeed version that changes it only
makes ``locate`` return None (the caller then writes the bytes itself). The pipeline engine, which
writes its stage files itself, hands each saved object to ``record`` instead.

``OpenedFiles`` reads a located range back: ``torch.load(mmap=True)`` maps the file, so a rank
touches only the pages of the ranges it asks for, never the whole file.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch


class SavedTensors:
    """``with SavedTensors(ds_engine, root) as saved: ds_engine.save_checkpoint(...)`` (or, with
    ``ds_engine`` None, ``saved.record(file, obj)`` for each object the caller saves), then
    ``saved.locate(view)`` -> ``{"file": path relative to root, "path": [...], "offset": n}`` or None.
    The tensors saved must stay alive (and unchanged) until the last ``locate``: the index keeps
    their addresses, not the tensors."""

    def __init__(self, ds_engine, root: Path):
        self._engine, self._root = ds_engine, Path(root).resolve()
        self._saved: list[tuple[str, object]] = []
        self._index: dict[tuple, tuple[list[int], list[tuple]]] = {}

    def __enter__(self):
        if self._engine is None:
            return self
        checkpoint_engine = self._engine.checkpoint_engine
        original = checkpoint_engine.save

        def save(state_dict, path, *args, **kwargs):
            self.record(path, state_dict)
            return original(state_dict, path, *args, **kwargs)

        checkpoint_engine.save = save  # an instance attribute: `del` below restores the class's method
        return self

    def record(self, path, obj) -> None:
        """``obj`` was (or is being) written to ``path`` by torch.save."""
        self._saved.append((str(Path(path).resolve().relative_to(self._root)), obj))

    def __exit__(self, *exc):
        if self._engine is not None:
            del self._engine.checkpoint_engine.save
        if exc[0] is not None:
            return False
        for file, obj in self._saved:
            for path, t in _tensors(obj, []):
                if t.is_contiguous() and t.numel() > 0:
                    starts, entries = self._index.setdefault((t.dtype, t.device), ([], []))
                    entries.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), file, path))
        for starts, entries in self._index.values():
            entries.sort(key=lambda e: e[0])
            starts.extend(e[0] for e in entries)
        self._saved.clear()  # the index keeps addresses only, not the tensors
        return False

    def locate(self, view: torch.Tensor) -> dict | None:
        """Where the bytes of ``view`` (contiguous) went, if DeepSpeed saved a tensor holding them."""
        if not view.is_contiguous() or view.numel() == 0 or (view.dtype, view.device) not in self._index:
            return None
        starts, entries = self._index[(view.dtype, view.device)]
        begin, end = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
        for i in range(bisect.bisect_right(starts, begin) - 1, -1, -1):  # nearest start at or before it first
            start, stop, file, path = entries[i]
            if stop >= end:
                return {"file": file, "path": path, "offset": (begin - start) // view.element_size()}
        return None


def _tensors(obj, path: list):
    """(object path, tensor) for every tensor in nested dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, (str, int)) and not isinstance(k, bool):
                yield from _tensors(v, path + [k])
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, path + [i])


class OpenedFiles:
    """The engine's files of one checkpoint (DeepSpeed's, or the pipeline's stage files), each opened
    (memory-mapped) the first time it is needed."""

    def __init__(self, root: Path):
        self._root, self._open = Path(root), {}

    def read(self, ref: dict, numel: int) -> torch.Tensor:
        obj = self._load(ref["file"])
        for key in ref["path"]:
            obj = obj[key]
        return obj.reshape(-1).narrow(0, ref["offset"], numel)

    def _load(self, file: str):
        if file not in self._open:
            path = self._root / file
            if not path.is_file():
                from smp_adapter.errors import SMPCheckpointError

                raise SMPCheckpointError(f"{path} is missing: the checkpoint was copied incompletely; copy the "
                                         "whole <tag>_partial folder")
            try:  # the engine's own files: the same trust as DeepSpeed's loader, which unpickles them too
                try:
                    self._open[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
                except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
                    self._open[file] = torch.load(path, map_location="cpu", weights_only=False)
            except (OSError, RuntimeError) as exc:  # cut short: torch's "[Errno 22]" names no file
                from smp_adapter.errors import SMPCheckpointError

                raise SMPCheckpointError(f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}): it is "
                                         "damaged or cut short; run `smp-adapter checkpoint verify` on the "
                                         "checkpoint, or use an older tag") from None
        return self._open[file]
