"""Checkpoints that cannot silently lie (runtime/checkpoint/integrity/manifest.py): one partial checkpoint per
layout (ZeRO-3 2 and dp 2 with the ViT script, tp 2 GPT-2, pp 2 GPT-2, each saved after step 4 of 8),
then copies of it damaged in each way a store damages files: one bit flipped in the middle of the
largest tensor record of an engine file, of a layout-independent piece, of the user content; the
largest engine file cut short by one byte; a file removed; the manifest edited. `checkpoint verify`,
`export --to hf`, `reshard` and resume's own check (the function every rank runs, here in one
process) all refuse, naming the file. A multi-rank resume of one damaged engine file per layout
refuses on every rank (none hangs); under dp 2 that file is the model file both ranks read, recorded in
64 KiB chunks that both ranks check. The intact checkpoint verifies clean and resumes bit-exactly:
steps 5-8 equal the uninterrupted run's, the same layout reading the same files."""

import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from common import tiny_vit
from launch_util import ROOT, run_ranks

from smp_adapter.cli import main
from smp_adapter.errors import SMPCheckpointError
from smp_adapter.runtime.checkpoint.integrity import manifest as digests
from smp_adapter.runtime.checkpoint.integrity import resume_check as digest_check
from smp_adapter.runtime.checkpoint.integrity.sidecars import write_sidecar

SDP_EXACT = {"sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
VIT, TP, PP = (ROOT / f"tests/distributed/scripts/{s}.py" for s in ("train_vit", "train_tp", "train_pp"))
# layout -> (script, options, processes, script arguments); global batch 8 in each
LAYOUTS = {
    "ZeRO-3 2": (VIT, {"ddp": True, "sharded_data_parallel_degree": 2, **SDP_EXACT}, 2, ["--per-rank-batch", 4]),
    "dp 2": (VIT, {"ddp": True}, 2, ["--per-rank-batch", 4]),
    "tp 2": (TP, {"ddp": True, "tensor_parallel_degree": 2}, 2, ["--model", "gpt2", "--per-rank-batch", 4]),
    "pp 2": (PP, {"ddp": True, "microbatches": 2, "pipeline_parallel_degree": 2}, 2,
             ["--model", "gpt2", "--per-rank-batch", 8]),
}
FOLDER = "step4_partial"
CHUNK = 65536


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(tiny_vit().state_dict(), path)
    return str(path)


def _run(layout, out, init_weights, *args, timeout=240, env=None):
    script, options, nprocs, script_args = LAYOUTS[layout]
    extra = ["--init-weights", init_weights, "--lr", "1e-3"] if script == VIT else []
    # 64 KiB digest chunks: the tiny models' larger files are recorded chunk by chunk, as a large model's are
    env = {"SM_HP_MP_PARAMETERS": json.dumps(options), digests.CHUNK_ENV: str(CHUNK), **(env or {})}
    return run_ranks(script, nprocs, out_dir=out, env=env, timeout=timeout,
                     args=[*script_args, *extra, "--optimizer", "adam", *args])


@pytest.fixture(scope="module")
def saved(tmp_path_factory, init_weights):
    """Each layout once: 8 uninterrupted steps, a partial checkpoint after step 4."""
    cache = {}

    def get(layout):
        if layout not in cache:
            root = tmp_path_factory.mktemp(layout.replace(" ", "_"))
            full = _run(layout, root / "run", init_weights, "--steps", 8, "--save-at", 4, "--ckpt-dir", root / "ckpt")
            cache[layout] = (root / "ckpt", full[0]["losses"])
        return cache[layout]

    return get


# -- damage ----------------------------------------------------------------------------------------
def _largest_record(path: Path) -> tuple[int, int]:
    """(offset, size) of the largest stored record of a torch.save file (a zip, stored uncompressed)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _payload(path: Path) -> tuple[int, int]:
    """(offset, size) of the tensor bytes: a safetensors file's data section, a torch file's largest record."""
    if path.suffix == ".safetensors":
        header = struct.unpack("<Q", path.read_bytes()[:8])[0]
        size = path.stat().st_size - 8 - header
        return (8 + header, size) if size > 0 else (8, header)  # no tensors of its own: its index
    return _largest_record(path)


def _flip_middle_bit(path: Path) -> None:
    offset, size = _payload(path)
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _engine_file(folder: Path) -> str:
    """The largest engine file (DeepSpeed's under ds/, or the pipeline's stage/optimizer files)."""
    files = [p for p in folder.rglob("*.pt") if p.name.startswith(("zero_pp_rank", "mp_rank", "stage_pp", "optimizer_pp"))]
    return max(files, key=lambda p: p.stat().st_size).relative_to(folder).as_posix()


def _damage(folder: Path, kind: str) -> str:
    """Damage the checkpoint copy in ``folder`` one way; return the file that now differs."""
    if kind == "manifest edited":
        manifest = json.loads((folder / digests.MANIFEST).read_text())
        manifest["universal"]["step"] = 1.0  # the Adam step count a resume would restore
        (folder / digests.MANIFEST).write_text(json.dumps(manifest, indent=1))
        return digests.MANIFEST
    name = {"bit in engine file": _engine_file(folder), "cut short": _engine_file(folder),
            "bit in layout-independent piece": "universal/rank0.safetensors", "bit in user content": "user_content.pt",
            "file removed": "rng_rank1.pt"}[kind]
    path = folder / name
    if kind == "file removed":
        path.unlink()
    elif kind == "cut short":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1)
    else:
        _flip_middle_bit(path)
    return name


DAMAGE = ["bit in engine file", "bit in layout-independent piece", "bit in user content", "cut short", "file removed",
          "manifest edited"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_intact_checkpoint_verifies_clean_and_resumes_bit_exactly(tmp_path, saved, init_weights, layout, capsys):
    ckpt, uninterrupted = saved(layout)
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "match their xxh3_128 digests" in capsys.readouterr().out or digests.default_algorithm() == "blake2b"
    manifest = json.loads((ckpt / FOLDER / digests.MANIFEST).read_text())
    on_disk = {p.relative_to(ckpt / FOLDER).as_posix() for p in (ckpt / FOLDER).rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {digests.MANIFEST}  # every file, DeepSpeed's own included
    resumed = _run(layout, tmp_path, init_weights, "--steps", 4, "--first-step", 4, "--resume", "--ckpt-dir", ckpt)
    assert resumed[0]["losses"] == uninterrupted[4:]  # bitwise: the same layout reads the same values


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_reader_refuses_a_damaged_checkpoint_naming_the_file(tmp_path, saved, layout, kind, capsys, monkeypatch):
    ckpt, _ = saved(layout)
    folder = tmp_path / FOLDER
    shutil.copytree(ckpt / FOLDER, folder)
    name = _damage(folder, kind)
    assert main(["checkpoint", "verify", str(folder)]) == 1
    out = capsys.readouterr()
    assert f"{folder / name}: " in out.out and out.out.count("\n") == 1, out.out  # one line: the damaged file
    for argv in (["export", str(folder), "--to", "hf", str(tmp_path / "hf")],
                 ["reshard", str(folder), "--to", json.dumps({"ddp": True}), "--world-size", "1", str(tmp_path / "r")]):
        assert main(["checkpoint", *argv]) == 2
        err = capsys.readouterr().err
        assert f"{folder} is damaged; refusing to {argv[0]} it (1 problem):\n  {folder / name}: " in err, err
        assert "smp-adapter checkpoint verify" in err and f"{digests.SKIP_ENV}=1" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "r").exists()
    with pytest.raises(SMPCheckpointError, match=f"refusing to resume from it .*\n  {folder / name}: "):
        digest_check.require_intact_everywhere(folder, "resume from it", rank=0, world_size=1)
    if kind == "cut short" and name.startswith("ds/"):  # read unchecked: still named, never a bare OSError
        monkeypatch.setenv(digests.SKIP_ENV, "1")
        assert main(["checkpoint", "export", str(folder), "--to", "hf", str(tmp_path / "hf")]) == 2
        assert f"{folder / name} cannot be read (" in capsys.readouterr().err


DAMAGED_RESUME = {"ZeRO-3 2": "cut short", "dp 2": "bit in engine file", "tp 2": "bit in engine file",
                  "pp 2": "bit in engine file"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_of_a_damaged_checkpoint_ends_every_rank_with_the_error(tmp_path, saved, init_weights, layout):
    ckpt, _ = saved(layout)
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    name = _damage(copy / FOLDER, DAMAGED_RESUME[layout])
    with pytest.raises(AssertionError, match="exit codes") as failed:  # a hang fails with "did not finish"
        _run(layout, tmp_path / "run", init_weights, "--steps", 1, "--first-step", 4, "--resume", "--ckpt-dir", copy,
             timeout=120)
    logs = str(failed.value)
    nprocs = LAYOUTS[layout][2]
    assert logs.count(f"is damaged; refusing to resume from it (1 problem):\n  {copy / FOLDER / name}: ") == nprocs
    assert "OSError" not in logs and "[Errno 22]" not in logs
    if layout == "dp 2":  # the model file both ranks read: its chunks are checked by both, the damaged one by one
        files = json.loads((copy / FOLDER / digests.MANIFEST).read_text())["files"]
        assert len(files[name]["chunks"]) > 2 and all(name in {n for n, _ in share} for share in digests.shares(files, 2))
        assert f"{copy / FOLDER / name}: content differs from the save (xxh3_128 digest of bytes " in logs


@pytest.mark.parametrize("layout", ["dp 2", "pp 2"])
def test_hashing_on_spare_cores_resumes_bit_exactly_and_refuses_damage_on_every_rank(tmp_path, saved, init_weights,
                                                                                     layout):
    """The resume's other way of hashing (runtime/checkpoint/integrity/spare_cores.py: threads hash each file the
    engine opens, beside its load; chosen where each local rank has a spare core, forced here, where
    two ranks share two cores): the same bitwise resume, the same refusal on every rank. Under dp 2
    both ranks' threads hash alternate chunks of the model file both read."""
    ckpt, uninterrupted = saved(layout)
    threads = {"SMP_ADAPTER_DIGEST_THREADS": "2"}
    resumed = _run(layout, tmp_path / "intact", init_weights, "--steps", 4, "--first-step", 4, "--resume",
                   "--ckpt-dir", ckpt, env=threads)
    assert resumed[0]["losses"] == uninterrupted[4:]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    name = _damage(copy / FOLDER, "bit in engine file")
    with pytest.raises(AssertionError, match="exit codes") as failed:
        _run(layout, tmp_path / "run", init_weights, "--steps", 1, "--first-step", 4, "--resume", "--ckpt-dir", copy,
             timeout=120, env=threads)
    logs = str(failed.value)
    assert logs.count(f"is damaged; refusing to resume from it (1 problem):\n  {copy / FOLDER / name}: content "
                      "differs from the save") == 2, logs


def test_smp_load_of_a_damaged_file_ends_every_rank_with_the_error(tmp_path, init_weights):
    """Every rank smp.loads the same weights (the fine-tune pattern, partial=False) from a file whose
    digest record (smp.save's <file>.smp_digest) no longer holds: each rank refuses it, naming it,
    before any collective (none waits for another), and nothing is written or rewritten."""
    weights = tmp_path / "init.pt"
    shutil.copyfile(init_weights, weights)
    write_sidecar(str(weights))  # as smp.save records it
    _flip_middle_bit(weights)
    damaged = weights.read_bytes()
    with pytest.raises(AssertionError, match="exit codes") as failed:  # a hang fails with "did not finish"
        _run("dp 2", tmp_path / "run", str(weights), "--steps", 1, "--save-at", 1, "--ckpt-dir", tmp_path / "ckpt",
             timeout=120)
    logs = str(failed.value)
    assert logs.count(f"{tmp_path} is damaged; refusing to load it (1 problem):\n  {weights}: content differs from "
                      "the save") == 2, logs
    assert weights.read_bytes() == damaged and not (tmp_path / "ckpt").exists()


def test_checkpoint_without_digests_still_loads_with_one_warning(tmp_path, saved, capsys):
    """Saved before digests were recorded: the manifest has no digest fields. It is used unchecked,
    with one warning; `verify` says there is nothing to check it against."""
    ckpt, _ = saved("dp 2")
    folder = tmp_path / FOLDER
    shutil.copytree(ckpt / FOLDER, folder)
    manifest = json.loads((folder / digests.MANIFEST).read_text())
    for key in (digests.FILES, digests.ALGORITHM, digests.SELF):
        del manifest[key]
    (folder / digests.MANIFEST).write_text(json.dumps(manifest))
    digests._warned.clear()
    with pytest.warns(UserWarning, match="records no file digests .* it is used unchecked"):
        assert digest_check.require_intact_everywhere(folder, "resume from it", 0, 1) == manifest
    assert main(["checkpoint", "export", str(folder), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert main(["checkpoint", "verify", str(folder)]) == 1
    assert "records no file digests" in capsys.readouterr().err
