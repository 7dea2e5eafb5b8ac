"""Checkpoint file primitives shared by every checkpoint writer (a leaf: imports nothing of ours
but ``state``, the errors and the digests' leaf).

* ``atomic_torch_save``: write to a temporary name, then rename, so a crash never leaves a torn file
  (hashed as written: its digest returned, for the checkpoint's records);
* ``safe_torch_load``: ``torch.load(weights_only=True)``, letting through the plain-data objects client
  scripts store (transformers configs, argparse.Namespace), with a clear error for anything else;
* the marks a partial state dict carries (``PARTIAL_MARK``, ``LAYOUT_MARK``) and the layout check
  that refuses to load a partial checkpoint into another parallel layout.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile

import torch

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint.integrity import saving
from smp_adapter.runtime.checkpoint.integrity.manifest import MANIFEST  # noqa: F401 - its one home
from smp_adapter.runtime.checkpoint.storage import atomic_write
from smp_adapter.runtime.state import state

PARTIAL_MARK = "_smp_is_partial"
LAYOUT_MARK = "_smp_layout"
ENGINE_FILES = "engine_files"  # manifest key; false: no engine files, resume from the universal pieces


def layout_record(d) -> dict:
    """The layout a checkpoint records (``ParallelDims`` -> JSON), compared on resume. ``stages``: the
    pipeline rank of each stage the model is cut into ([0, 1] for 1F1B at pp 2; [0, 1, 0, 1] for
    interleaved_1f1b, [0, 1, 1, 0] for zbv), so a checkpoint saved under another pipeline schedule's
    stages is read from its layout-independent pieces, as one saved under another pp."""
    from smp_adapter.config.pipeline_schedule import stage_order

    return {"pp": d.pp, "tp": d.tp, "rdp": d.rdp, "sdp": d.sdp, "zero_stage": d.zero_stage, "engine": d.engine,
            "placement": d.grid.order, "world_size": d.world_size, "stages": stage_order(d.cfg, d.pp)}


def current_layout() -> dict:
    return layout_record(state.dims)


def layout_difference(saved: dict) -> str | None:
    """'tp: saved 2 vs now 1, ...' when ``saved`` is another parallel layout than this job's, else None."""
    now = current_layout()
    # checkpoints written before "stages" was recorded had one stage per pipeline rank
    # ... and were written by DeepSpeed at pp = 1 (sdp < rdp too: hpZ, before the MiCS engine), whose
    # files another engine (MiCS on the same degrees) cannot read: that is another layout
    saved = {"stages": list(range(saved.get("pp") or 1)),
             "engine": "pipeline" if (saved.get("pp") or 1) > 1 else "deepspeed", **saved}
    keys = ("pp", "tp", "rdp", "sdp", "zero_stage", "engine", "placement", "stages")
    diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
    return ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in diff.items()) if diff else None


def check_layout(saved: dict, what: str) -> None:
    detail = layout_difference(saved)
    if detail:
        raise SMPCheckpointError(
            f"{what} was saved with another parallel layout ({detail}). Partial checkpoints load only into the same "
            "layout: relaunch with the saved degrees (and pipeline schedule, for stages), or save a full checkpoint "
            "(partial=False) and load that instead")


def atomic_torch_save(obj, path: str, pickle_protocol: int = 2) -> dict:
    """torch.save, hashed as it is written; returns the file's {"size", "digest"} (default algorithm)."""
    return atomic_write(path, lambda tmp: saving.write_hashed(
        tmp, lambda f: torch.save(obj, f, pickle_protocol=pickle_protocol)))


# Checkpoints the AWS templates write hold more than tensors: a transformers config in user_content
# ("model_config"), an argparse Namespace, numpy scalars and dtypes (the GPT template's ``num_params``
# and its LR scheduler's state). Those are plain data, so they are let through torch's
# weights-only unpickler by name (it still runs no code of the file's choosing); anything else
# (a DataLoader, the script's own classes) needs the caller's explicit trust, as torch itself asks.
TRUST_ENV = "SMP_ADAPTER_TRUST_CHECKPOINTS"
_DATA_ONLY_CLASSES = {"argparse.Namespace"}
# numpy values as torch's weights_only documentation allows them: a scalar is rebuilt from its dtype
# and raw bytes, an array by _reconstruct + setstate; none of these runs code named by the file.
_NUMPY_DATA = {"numpy.dtype", "numpy.ndarray", "numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar",
               "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct"}


def _data_only_class(qualified: str):
    """The class named ``module.Class`` if it is plain data that may be unpickled: argparse.Namespace,
    or a transformers configuration (PretrainedConfig / GenerationConfig subclass); else None.
    numpy scalars, arrays and dtypes (``numpy.dtypes.Float64DType`` ...) count as plain data too.
    Only modules under ``transformers.``, ``numpy`` and ``argparse`` are imported to find out."""
    module_name, _, name = qualified.rpartition(".")
    if qualified.startswith("numpy."):
        return _numpy_data(qualified)
    if qualified not in _DATA_ONLY_CLASSES and not module_name.startswith("transformers."):
        return None
    import importlib

    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None
    if qualified in _DATA_ONLY_CLASSES:
        return cls
    from transformers import GenerationConfig, PretrainedConfig

    return cls if isinstance(cls, type) and issubclass(cls, (PretrainedConfig, GenerationConfig)) else None


def _numpy_data(qualified: str):
    import importlib

    import numpy as np

    module_name, _, name = qualified.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None
    if qualified in _NUMPY_DATA or (isinstance(found, type) and issubclass(found, np.dtype)):
        return found
    return None


def _numpy_dtype_classes() -> list:
    import numpy as np

    import numpy.dtypes

    return [np.dtype] + [c for c in vars(numpy.dtypes).values() if isinstance(c, type) and issubclass(c, np.dtype)]


def _trusted() -> bool:
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def _read_path(path):
    return contextlib.nullcontext(path)


def safe_torch_load(path: str, map_location=None, weights_only: bool = True, opener=_read_path, mmap: bool = False):
    """torch.load with weights_only=True, plus the plain-data classes above; ``weights_only=False``
    (or SMP_ADAPTER_TRUST_CHECKPOINTS=1 for the whole job) loads any pickle, as smp v1 did.
    ``opener(path)``: a context manager giving what torch.load reads (a resume's CheckpointIO hands
    a reader that hashes the bytes for its digest check, checkpoint/io.py); by default the path.
    ``mmap``: the tensors stay on a mapping of the file (read when touched; a sharding engine reads only
    its rows, runtime/file_backed.py), where the file is torch's zip format and read by path."""
    if not os.path.exists(path):
        raise SMPCheckpointError(f"checkpoint file {path} does not exist: check the path and tag")
    mmap = mmap and opener is _read_path and map_location in ("cpu", None) and zipfile.is_zipfile(path)
    if not weights_only or _trusted():
        return _load(path, map_location, False, opener, mmap)
    try:
        with opener(path) as source:
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        pass  # other Python objects in the file: see whether they are plain data
    except Exception as exc:  # noqa: BLE001 - zip/format errors: not a torch checkpoint
        _not_a_checkpoint(path, exc)
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - legacy (non-zip) format or a torn file
        _not_a_checkpoint(path, exc)
    classes = {name: _data_only_class(name) for name in needed}
    refused = sorted(name for name, cls in classes.items() if cls is None)
    if refused:
        raise SMPCheckpointError(
            f"{path} holds Python objects that are not plain data ({', '.join(refused[:5])}"
            f"{', ...' if len(refused) > 5 else ''}), and loading them would run code from the file. smp v1 "
            f"unpickled everything; smp-adapter does so only when told the file is trusted: set {TRUST_ENV}=1 for "
            "the job (smp-adapter launch passes the environment on), or pass weights_only=False to smp.load")
    allowed = list(classes.values())
    if any(name.startswith("numpy.") for name in classes):
        # a numpy value's dtype is rebuilt through its class (numpy.dtypes.Int64DType ...), which the
        # file names only once unpickling reaches it: all of them, and numpy.dtype itself
        allowed += _numpy_dtype_classes()
    with torch.serialization.safe_globals(allowed):
        return _load(path, map_location, True, opener, mmap)


def _load(path: str, map_location, weights_only: bool, opener, mmap: bool = False):
    try:
        with opener(path) as source:
            return torch.load(source, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - pickle / zip errors: the file is not a torch checkpoint
        _not_a_checkpoint(path, exc)


def _not_a_checkpoint(path: str, exc: Exception):
    raise SMPCheckpointError(
        f"{path} is not a loadable checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): a file "
        "written by torch.save / smp.save / smp.save_checkpoint was expected; check the path and tag") from None
