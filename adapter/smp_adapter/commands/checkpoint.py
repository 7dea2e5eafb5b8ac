"""``smp-adapter checkpoint inspect DIR`` and ``smp-adapter checkpoint export DIR --to hf OUT``:
partial checkpoints read without a process group (CPU only). DIR is a checkpoint's ``<tag>_partial``
directory, or the directory ``save_checkpoint`` wrote into (its ``newest`` tag is taken).

* inspect: the layout it was saved with, its tag, files and sizes, and what a resume needs;
* export --to hf: the model in Hugging Face's ``save_pretrained`` layout (``config.json`` and
  ``model.safetensors``), rebuilt from the layout-independent pieces (docs/checkpoints.md), one
  parameter at a time; loads with ``from_pretrained``. Tied parameters are written once, as
  ``save_pretrained`` does;
* reshard --to OPTIONS --world-size N: the checkpoint rewritten for that layout
  (commands/checkpoint_reshard.py);
* verify: every file checked against the digests recorded at the save (runtime/checkpoint/integrity/manifest.py),
  one line per problem; export and reshard make the same check first and refuse a damaged checkpoint.
  A full checkpoint (``partial=False``: DIR's ``newest`` tag is a model file) or a file smp.save wrote
  is checked against its ``<file>.smp_digest`` records (runtime/checkpoint/integrity/sidecars.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from smp_adapter.commands import checkpoint_reshard
from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import sidecars

MANIFEST = digests.MANIFEST
# --help's words: what each action does for the user (the module docstring above says where the code is)
HELP = """Read and rewrite smp checkpoints without a GPU or a process group. DIR is a checkpoint's
<tag>_partial directory, or the directory smp.save_checkpoint wrote into (its newest tag is taken).

  inspect DIR                   the layout it was saved with, its tag, files and sizes, and what a
                                resume needs
  export DIR --to hf OUT        the model in Hugging Face's save_pretrained layout (config.json,
                                model.safetensors); from_pretrained loads it
  reshard DIR --to OPTIONS --world-size N OUT
                                the checkpoint rewritten for another layout (docs/checkpoints.md)
  verify DIR                    every file checked against the digests recorded at the save, one line
                                per problem; export and reshard check first and refuse a damaged one.
                                A full checkpoint, or a file smp.save wrote, is checked against its
                                <file>.smp_digest records
"""


def add_parser(subparsers):
    p = subparsers.add_parser("checkpoint", help="inspect, export or reshard a partial checkpoint (no GPU, no process group)",
                              description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="layout, tag, files and what a resume needs")
    inspect.add_argument("dir", metavar="DIR")
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    export = sub.add_parser("export", help="write the model in another format")
    export.add_argument("dir", metavar="DIR")
    export.add_argument("--to", choices=("hf",), required=True, help="hf: Hugging Face save_pretrained layout")
    export.add_argument("out", metavar="OUT")
    checkpoint_reshard.add_parser(sub)
    verify = sub.add_parser("verify", help="check every file against the digests recorded at the save (the manifest; "
                            "a full checkpoint's or an smp.save file's <file>.smp_digest)")
    verify.add_argument("dir", metavar="DIR")
    return p


def _find(path: str) -> Path:
    folder = Path(path)
    if not (folder / MANIFEST).exists() and (folder / "newest").exists():
        folder = folder / f"{(folder / 'newest').read_text().strip()}_partial"
    return folder


def _folder(path: str) -> tuple[Path, dict]:
    folder = _find(path)
    if not (folder / MANIFEST).is_file():
        raise SMPCheckpointError(f"{path} is not a complete smp-adapter partial checkpoint (no {MANIFEST}): give the "
                                 "<tag>_partial directory, or the directory save_checkpoint wrote into")
    try:
        return folder, json.loads((folder / MANIFEST).read_text())
    except ValueError as exc:
        raise SMPCheckpointError(f"{folder / MANIFEST} is not valid JSON ({exc}): the checkpoint is damaged") from None


def _summary(folder: Path, manifest: dict) -> dict:
    files = [p for p in folder.rglob("*") if p.is_file()]
    universal = manifest.get("universal")
    layout = manifest.get("layout", {})
    if universal is None:
        resume = ("only the saved layout (no layout-independent pieces: saved by an older smp-adapter or with "
                  "SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0)")
    else:
        resume = "any pp = 1 layout (dp size, ZeRO stage, hpZ, tp degree, world size may differ)"
    return {"dir": str(folder), "tag": manifest.get("tag"), "format": manifest.get("format"), "layout": layout,
            "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "index_bytes": sum(  # the pieces' index: their values point into DeepSpeed's files
                p.stat().st_size for p in (folder / "universal").glob("*.safetensors")),
            "optimizer_state": (universal or {}).get("state_keys"), "step": (universal or {}).get("step"),
            "model_class": (universal or {}).get("model_class"),
            "hf_config": bool((universal or {}).get("hf_config")), "resume": resume,
            "digests": (f"{manifest[digests.ALGORITHM]}, {len(manifest[digests.FILES])} files (check them: "
                        "smp-adapter checkpoint verify)" if digests.has_digests(manifest) else "none recorded")}


def _verify(path: str) -> int:
    """One line per problem (the file, what is wrong); exit 0 only when every file holds."""
    full = _full_files(path)
    if full is not None:
        return _verify_full(path, full)
    folder = _find(path)
    if not folder.is_dir():
        raise SMPCheckpointError(f"{path} is not a directory: give a <tag>_partial directory, the directory "
                                 "save_checkpoint wrote into, or a file smp.save wrote")
    manifest, problems = digests.verify(folder)
    if _said_problems(problems, folder, folder, "do not resume or export it; use an older tag"):
        return 1
    if not digests.has_digests(manifest):
        print(f"{folder}: records no file digests (saved before smp-adapter recorded them): nothing to check "
              "it against", file=sys.stderr)
        return 1
    print(f"{folder}: {len(manifest[digests.FILES])} files and the manifest match their "
          f"{manifest[digests.ALGORITHM]} digests")
    return 0


def _said_problems(problems, folder: Path, subject, advice: str) -> bool:
    """One line per problem (the file's path, what is wrong), then the verdict on stderr."""
    for problem in problems:
        print(f"{folder / problem.file}: {problem.what}")
    if problems:
        print(f"{subject}: {len(problems)} problem{'s' if len(problems) > 1 else ''}: {advice}, or copy it again "
              "from its source", file=sys.stderr)
    return bool(problems)


def _full_files(path: str) -> list[Path] | None:
    """The files of a full checkpoint (``save_checkpoint(partial=False)`` into DIR: its ``newest`` tag's
    model file and user content), or the one file smp.save wrote; None for a partial checkpoint."""
    given = Path(path)
    if given.is_file():
        return [given]
    newest = given / "newest"
    if (given / MANIFEST).exists() or not newest.is_file():
        return None
    tag = newest.read_text().strip()
    if (given / f"{tag}_partial").is_dir() or not (given / tag).is_file():
        return None
    uc = given / f"user_content_{tag}"
    return [given / tag, *([uc] if uc.exists() or Path(f"{uc}{sidecars.SIDECAR}").exists() else [])]


def _verify_full(path: str, files: list[Path]) -> int:
    problems = []
    for file in files:
        manifest, bad = sidecars.read_sidecar(file)
        if manifest is None and not bad:
            bad = [digests.Problem(file.name, f"has no {sidecars.SIDECAR} record (written by torch.save, or by an "
                                              "smp-adapter before digests existed): nothing to check it against")]
        problems += bad or sidecars.sidecar_problems(file)
    if _said_problems(problems, files[0].parent, path, "do not load it; use an older checkpoint"):
        return 1
    print(f"{path}: {len(files)} file{'s' if len(files) > 1 else ''} match their {sidecars.SIDECAR} records")
    return 0


def run(args) -> int:
    if args.action == "verify":
        return _verify(args.dir)
    folder, manifest = _folder(args.dir)
    if args.action in ("export", "reshard"):  # every file checked before anything is read
        manifest = digests.require_intact(folder, f"{args.action} it")
    if args.action == "inspect":
        info = _summary(folder, manifest)
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            for key, value in info.items():
                print(f"{key:16} {value}")
        return 0
    if args.action == "reshard":
        dims = checkpoint_reshard.target_dims(args.to, args.world_size)
        final = checkpoint_reshard.reshard(folder, manifest, dims, Path(args.out))
        print(f"wrote {final}: resume it with {args.world_size} processes and those options "
              f"(layout {json.dumps(manifest.get('layout'))} -> tp {dims.tp}, rdp {dims.rdp}, ZeRO {dims.zero_stage})")
        return 0
    return _export_hf(folder, manifest, Path(args.out))


def _export_hf(folder: Path, manifest: dict, out: Path) -> int:
    from safetensors.torch import save_file

    from smp_adapter.runtime.checkpoint.universal import NO_PIECES, Pieces

    universal = manifest.get("universal")
    if not universal:
        raise SMPCheckpointError(f"{folder} {NO_PIECES}: resume it with its layout and save a full checkpoint "
                                 "(partial=False), or a partial one without that setting")
    if not universal.get("hf_config"):
        raise SMPCheckpointError(f"{folder} records no Hugging Face config (the model, {universal.get('model_class')}, "
                                 "is not a transformers PreTrainedModel): export needs one")
    pieces = Pieces(folder)
    tensors = {name: pieces.full(name).contiguous() for name in pieces.names("param")}
    tensors.update({name: pieces.full(name, "buffer").contiguous() for name in pieces.names("buffer")})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(universal["hf_config"], indent=2, sort_keys=True))
    print(f"wrote {out / 'model.safetensors'} ({len(tensors)} tensors) and {out / 'config.json'}")
    return 0
