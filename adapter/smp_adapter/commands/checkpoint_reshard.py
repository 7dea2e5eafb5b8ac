"""``smp-adapter checkpoint reshard DIR --to OPTIONS --world-size N OUT``: rewrite a partial
checkpoint once for the layout a later job will run with (no process group, CPU only).

The output is a partial checkpoint (``OUT/<tag>_partial`` and ``OUT/newest``) holding only
layout-independent pieces, cut for the target: one ``universal/tp<T>.safetensors`` per target TP rank
with that rank's TP shard of every split parameter (parameters every TP rank holds whole go, whole,
into ``tp0``), with their optimizer state, plus the buffers and ``user_content``. Its manifest
records the target layout and ``"engine_files": false``, so ``resume_from_checkpoint`` under that
layout reads the pieces (ZeRO partitions are cut from them at load), and every rank reads only its
own TP shard. A pipeline target (pp > 1) reads the same files: each stage takes its own parameters
from them. Any other layout can resume it too, as any partial checkpoint. RNG states are not carried
(they mean something only in the saving layout).

Limits: a parameter that the source held whole but the target splits by tensor parallelism is written whole
(the resuming job splits it, as when it resumes the source directly). Memory: one output file's
tensors at a time (about the model / target tp).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from smp_adapter.errors import SMPCheckpointError


def add_parser(sub) -> None:
    p = sub.add_parser("reshard", help="rewrite a partial checkpoint for another layout")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--to", required=True, metavar="OPTIONS",
                   help="the target job's smp options or distribution dict (file or inline JSON)")
    p.add_argument("--world-size", type=int, required=True, metavar="N", help="the target job's number of processes")
    p.add_argument("out", metavar="OUT", help="directory to write (must not hold this tag yet)")


def target_dims(options: str, world_size: int):
    from smp_adapter.config.dims import ParallelDims, sdp_engine_from
    from smp_adapter.config.distribution import load_job

    return ParallelDims.from_config(load_job(options).config(), world_size, sdp_engine_from(os.environ))  # as launch


def reshard(folder: Path, manifest: dict, dims, out: Path) -> Path:
    """Write the resharded checkpoint; return its ``<tag>_partial`` directory."""
    from smp_adapter.parallel.layers import ShardLayout
    from smp_adapter.runtime.checkpoint.integrity import saving
    from smp_adapter.runtime.checkpoint.files import ENGINE_FILES, layout_record
    from smp_adapter.runtime.checkpoint.storage import atomic_write
    from smp_adapter.runtime.checkpoint.universal import FOLDER, NO_PIECES, IndexFile, Pieces

    universal = manifest.get("universal")
    if not universal:
        raise SMPCheckpointError(f"{folder} {NO_PIECES}: nothing to reshard it from; resume it with its own layout")
    tag = manifest.get("tag") or folder.name.removesuffix("_partial")
    final = out / f"{tag}_partial"
    if final.exists():
        raise SMPCheckpointError(f"{final} exists already: give an empty OUT directory, or remove it first")
    pieces, tp = Pieces(folder), dims.tp
    files = [IndexFile() for _ in range(tp)]  # one per target TP rank

    def add(tp_rank: int, name: str, kind: str, values, layout, **extra):
        files[tp_rank].add(name, kind, 0, values.reshape(-1), list(values.shape), tp_rank, tp, layout, **extra)

    for kind in ["param", *universal.get("state_keys", [])]:
        for name in pieces.names(kind):
            layout = pieces.by_name[(name, kind)][0]["layout"]
            full = pieces.full(name, kind)  # one parameter at a time
            if layout is None or tp == 1:  # whole on every target TP rank
                add(0, name, kind, full, None)
                continue
            split = ShardLayout(tuple(layout["full_shape"]), layout["dim"], layout["parts"], layout["transposed"])
            for t in range(tp):
                add(t, name, kind, split.shard(full, t, tp), layout)
    for name in pieces.names("buffer"):
        add(0, name, "buffer", pieces.tp_shard(name, "buffer", 0), None,
            dtype=pieces.by_name[(name, "buffer")][0].get("dtype"))

    staging = out / f".{tag}_partial.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / FOLDER).mkdir(parents=True)
    for t, f in enumerate(files):
        f.save(staging / FOLDER / f"tp{t}.safetensors")
    if (folder / "user_content.pt").is_file():
        shutil.copy2(folder / "user_content.pt", staging / "user_content.pt")
    record = {"tag": tag, "layout": layout_record(dims), "format": manifest.get("format"), "universal": universal,
              ENGINE_FILES: False, "resharded_from": manifest.get("layout")}
    saving.write_manifest(staging, {**record, **saving.complete(staging, {}, saving.default_algorithm())})
    staging.rename(final)  # complete or absent, as save_checkpoint's folders
    atomic_write(out / "newest", lambda tmp: tmp.write_text(tag))
    return final
