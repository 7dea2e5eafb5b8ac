"""The save side of a partial checkpoint's digests: each file hashed as it is written
(``write_hashed``: torch.save into a file object that hashes each 1 MiB before writing it, while
those bytes are in the CPU's cache), the files some writer did not hash hashed right after
(``digest_written``: the safetensors index, another DeepSpeed checkpoint engine's files), every
rank's digests gathered, rank 0 digesting anything no rank claimed (``complete``: DeepSpeed's
``zero_to_fp32.py``) and writing the manifest, all inside the staging folder that is renamed into
place afterwards (the save stays atomic). Which files a rank wrote: the save's ``CheckpointIO``
(checkpoint/io.py). The manifest's format and the checks: integrity/manifest.py.

Callers look these functions up on this module when they call them (``saving.write_hashed(...)``),
so benchmarks/checkpoint.py can swap them for a save without digests.
"""

from __future__ import annotations

import json
from pathlib import Path

from smp_adapter.runtime.checkpoint.integrity import hashing_io
from smp_adapter.runtime.checkpoint.integrity.manifest import ALGORITHM, FILES, MANIFEST, SELF, own_digest
from smp_adapter.runtime.checkpoint.integrity.records import default_algorithm, digest_file
from smp_adapter.runtime.checkpoint.integrity.spare_cores import writer_helper


def write_hashed(path, write, algorithm: str | None = None) -> dict:
    """``hashing_io.write_hashed``, hashing beside the write on a spare core where this rank has one."""
    return hashing_io.write_hashed(path, write, algorithm, writer_helper())


def digest_written(root: Path, written, algorithm: str) -> dict:
    """{relative path: digest} of the files this rank wrote under ``root`` (``written``: (path,
    record) pairs; hashed now when their writer did not hash them)."""
    root = Path(root).resolve()
    out = {}
    for path, record in written:
        path = Path(path).resolve()
        if path.is_file() and path.is_relative_to(root):
            hashed = record if algorithm == default_algorithm() else None
            out[path.relative_to(root).as_posix()] = hashed or digest_file(path, algorithm)
    return out


def gather(own: dict, world_size: int) -> dict:
    """Every rank's digests, merged (collective: every rank calls it; it doubles as the barrier after
    which every rank's files are complete)."""
    if world_size == 1:
        return dict(own)
    import torch.distributed as dist

    views = [None] * world_size
    dist.all_gather_object(views, own)
    merged = {}
    for view in views:
        merged.update(view)
    return merged


def complete(root: Path, recorded: dict, algorithm: str) -> dict:
    """The manifest's digest fields for every file under ``root``: ``recorded`` plus the files no rank
    claimed (digested here)."""
    files = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST:
            files[rel] = recorded.get(rel) or digest_file(path, algorithm)
    return {ALGORITHM: algorithm, FILES: files}


def write_manifest(folder: Path, manifest: dict) -> None:
    """The manifest, carrying its own digest when it records file digests."""
    if ALGORITHM in manifest:
        manifest = {**manifest, SELF: own_digest(manifest, manifest[ALGORITHM])}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=1))
