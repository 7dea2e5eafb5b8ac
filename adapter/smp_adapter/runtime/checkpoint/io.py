"""The I/O of one partial checkpoint's save or resume, handed to the engine
(``Engine.save_partial(io, optimizer)`` / ``Engine.load_partial(io, ...)``).

One object given to the strategy instead of ambient hooks, as Lightning's ``CheckpointIO`` and
torchtitan's ``CheckpointManager`` do: the engine writes and reads its files through it, and it
remembers what the checkpoint's integrity needs: at a save, each file written with its digest (the
save's manifest records every one, checkpoint/dirs.py); at a resume, each file read goes through
the resume's digest check (integrity/resume_check.py ``Check.source``). Nothing is module state,
so two saves or resumes cannot see each other's files.

A write that fails for lack of space (any storage failure) does not raise inside the engine's save: it
is kept in ``failures`` and the engine's save goes on through the collectives every rank runs;
checkpoint/dirs.py then makes every rank agree on the failure and raise it (runtime/agreement.py).
A rank raising in the middle left the others in a collective it never entered: a gloo abort, SIGABRT.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from smp_adapter.runtime.checkpoint.files import atomic_torch_save, safe_torch_load
from smp_adapter.runtime.checkpoint.integrity import saving


@dataclass
class CheckpointIO:
    """``folder``: the staging folder of a save, the checkpoint folder of a resume. ``written``: the
    (path, record) of each file this rank wrote (record: its default-algorithm digest when it was
    hashed while written, else None: hashed at the end of the save). ``check``: the resume's
    ``resume_check.Check``, or None (a save, or a read that checks nothing). ``failures``: the storage
    failures (exceptions) of this rank's writes, in order."""

    folder: Path
    check: object | None = None
    written: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    def note(self, path, record: dict | None = None) -> None:
        """A file this rank has completed, with its digest when it was hashed while written."""
        self.written.append((Path(path), record))

    def write(self, path, write) -> bool:
        """``write(path)`` creates the file ``path``: noted when it did; a storage failure is kept in
        ``failures`` (False returned), not raised, so that this rank still runs the save's collectives."""
        from smp_adapter.runtime.checkpoint.storage import is_storage_failure

        try:
            record = write(path)
        except Exception as exc:
            if not is_storage_failure(exc):
                raise
            self.failures.append(exc)
            return False
        self.note(path, record if isinstance(record, dict) else None)
        return True

    def torch_save(self, obj, path) -> bool:
        """torch.save, atomic and hashed as written (files.atomic_torch_save), into its folder (created), noted
        (``write``: a full disk, also at the folder's creation, is kept in ``failures``)."""
        def save(p):
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            return atomic_torch_save(obj, str(p))

        return self.write(path, save)

    @contextlib.contextmanager
    def keeping_failures(self, owner, method: str):
        """``owner.method`` (an instance's) records its storage failures in ``failures`` instead of raising,
        for the duration (DeepSpeed's copy of its recovery script, a write outside its checkpoint engine)."""
        from smp_adapter.runtime.checkpoint.storage import is_storage_failure

        if not hasattr(owner, method):  # another release without it: nothing to guard
            yield
            return
        had_own, original = method in vars(owner), getattr(owner, method)

        def guarded(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                if not is_storage_failure(exc):
                    raise
                self.failures.append(exc)
                return None

        setattr(owner, method, guarded)
        try:
            yield
        finally:
            if had_own:
                setattr(owner, method, original)
            else:
                vars(owner).pop(method, None)

    @contextlib.contextmanager
    def source(self, path, shared_by: tuple[int, int] = (0, 1)):
        """``with io.source(path) as source: torch.load(source, ...)``: what torch.load should read,
        a reader hashing the bytes for the resume's check, or the path itself (``Check.source``;
        ``shared_by`` = (position, count) of the ranks that read this file whole)."""
        if self.check is None:
            yield path
        else:
            with self.check.source(path, shared_by) as source:
                yield source

    def torch_load(self, path, map_location=None, weights_only: bool = True):
        """files.safe_torch_load, reading through ``source``."""
        return safe_torch_load(str(path), map_location, weights_only, opener=self.source)

    @contextlib.contextmanager
    def noting_saves(self, checkpoint_engine, writes_with_torch_save: bool):
        """DeepSpeed's checkpoint engine writes its files itself: note each path it saves to. Its default
        engine (``writes_with_torch_save``: ``torch.save(state_dict, path)``) is handed a hashing file
        object instead of the path, so the file is hashed as it is written; any other engine's files
        are hashed after the save.

        The storage failures (disk full, any OSError) of its writes do not raise inside DeepSpeed's save,
        whose collectives (barriers, ZeRO-3's gathers) the other ranks are waiting in: they are kept in
        ``failures`` (checkpoint/dirs.py makes every rank raise the first once the engine's save returned)."""
        from smp_adapter.runtime.checkpoint.storage import is_storage_failure

        had_own = "save" in vars(checkpoint_engine)
        original = checkpoint_engine.save
        failures = self.failures

        def save(state_dict, path, *args, **kwargs):
            try:
                if writes_with_torch_save and isinstance(path, (str, os.PathLike)):
                    self.note(path, saving.write_hashed(path, lambda f: original(state_dict, f, *args, **kwargs)))
                    return None
                result = original(state_dict, path, *args, **kwargs)
            except Exception as exc:
                if not is_storage_failure(exc):
                    raise
                failures.append(exc)
                return None
            self.note(path)
            return result

        checkpoint_engine.save = save
        try:
            yield
        finally:
            if had_own:
                checkpoint_engine.save = original
            else:
                vars(checkpoint_engine).pop("save", None)
