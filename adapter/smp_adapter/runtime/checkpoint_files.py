"""Checkpoint file primitives shared by every checkpoint writer (a leaf: imports nothing of ours
but ``state`` and the errors).

* ``atomic_torch_save``: write to a temporary name, then rename, so a crash never leaves a torn file;
* ``safe_torch_load``: ``torch.load(weights_only=True)`` with a clear error for a missing or foreign file;
* the marks a partial state dict carries (``PARTIAL_MARK``, ``LAYOUT_MARK``) and the layout check
  that refuses to load a partial checkpoint into another parallel layout.
"""

from __future__ import annotations

import os

import torch

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.state import state

PARTIAL_MARK = "_smp_is_partial"
LAYOUT_MARK = "_smp_layout"
MANIFEST = "smp_manifest.json"
ENGINE_FILES = "engine_files"  # manifest key; false: no engine files, resume from the universal pieces


def layout_record(d) -> dict:
    """The layout a checkpoint records (``ParallelDims`` -> JSON), compared on resume."""
    return {"pp": d.pp, "tp": d.tp, "rdp": d.rdp, "sdp": d.sdp, "zero_stage": d.zero_stage,
            "placement": d.grid.order, "world_size": d.world_size}


def current_layout() -> dict:
    return layout_record(state.dims)


def layout_difference(saved: dict) -> str | None:
    """'tp: saved 2 vs now 1, ...' when ``saved`` is another parallel layout than this job's, else None."""
    now = current_layout()
    keys = ("pp", "tp", "rdp", "sdp", "zero_stage", "placement")
    diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
    return ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in diff.items()) if diff else None


def check_layout(saved: dict, what: str) -> None:
    detail = layout_difference(saved)
    if detail:
        raise SMPCheckpointError(
            f"{what} was saved with another parallel layout ({detail}). Partial checkpoints load only into the same "
            "layout: relaunch with the saved degrees, or save a full checkpoint (partial=False) and load that instead")


def atomic_torch_save(obj, path: str, pickle_protocol: int = 2) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp, pickle_protocol=pickle_protocol)
    os.replace(tmp, path)


def safe_torch_load(path: str, map_location=None, weights_only: bool = True):
    if not os.path.exists(path):
        raise SMPCheckpointError(f"checkpoint file {path} does not exist: check the path and tag")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # pickle / zip errors: the file is not a (safe) torch checkpoint
        raise SMPCheckpointError(
            f"{path} is not a loadable checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Loading "
            "uses torch.load(weights_only=True); if you trust a file holding other Python objects, pass "
            "weights_only=False to smp.load") from None
