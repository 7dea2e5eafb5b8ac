"""The layout-independent checkpoint format (docs/checkpoints.md): the index each rank writes, the
writer both engines share (``write_index``) and the reader (``Pieces``, also used by the
``smp-adapter checkpoint`` commands without a process group). What each engine records is in
runtime/engines/deepspeed/universal_checkpoint.py (DeepSpeed) and runtime/engines/pipeline/checkpoint.py (pipeline).

On disk: ``<tag>_partial/universal/rank<R>.safetensors``, one per rank, whose safetensors metadata
holds an index. An entry describes a 1-D piece of one parameter's *TP shard* (the tensor a rank
holds before ZeRO, in its stored orientation) of one kind (``param``: the fp32 master; ``exp_avg``,
``exp_avg_sq``, ...: optimizer state):

    name        the parameter's name in the module (tied parameters: the first name)
    kind        param | <optimizer state key> | buffer
    start/stop  the piece's range in the flattened TP shard
    shard_shape the TP shard's shape
    tp_rank/tp_size, layout   where the TP shard sits in the full tensor (ShardLayout fields, or
                null for a parameter every TP rank holds whole)
    ref         where the values are: {"file", "path", "offset"} into one of the engine's own files
                of this checkpoint (DeepSpeed's, or the pipeline's stage files; runtime/checkpoint/refs.py),
                or, when those files do not hold them (persistent buffers; a DeepSpeed version that
                copies before saving),
    key         the tensor in this safetensors file that holds them (fp32; buffers keep their dtype)

So the pieces cost an index, not a second copy of the model: the values are the tensors DeepSpeed
has just written (its ZeRO flat partitions, its torch optimizer's state, the module's parameters),
found by address while DeepSpeed saved them. ``SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS=0``
writes DeepSpeed's files only (such a checkpoint resumes only under its own layout).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from smp_adapter.errors import SMPCheckpointError
from smp_adapter.parallel.layers import LAYOUT_ATTR, ShardLayout
from smp_adapter.runtime.state import state

FOLDER = "universal"
ENV_SWITCH = "SMP_ADAPTER_LAYOUT_INDEPENDENT_CHECKPOINTS"  # "0": the engine's own files only (same-layout resume)
NO_PIECES = (f"has no layout-independent pieces (saved by an older smp-adapter or with {ENV_SWITCH}=0)")
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad")
# DeepSpeed's loss scalers (the DeepSpeed engine's and the pipeline engine's are the same classes)
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def state_keys(optimizer) -> list[str]:
    """Tensor-valued optimizer state keys other than the step (exp_avg, exp_avg_sq for Adam)."""
    for st in optimizer.state.values():
        return sorted(k for k, v in st.items() if k != "step" and torch.is_tensor(v) and v.dim() > 0)
    return []


def step_count(optimizer) -> float | None:
    steps = [float(st["step"]) for st in optimizer.state.values() if "step" in st]
    return steps[0] if steps else None


def layout_of(p) -> dict | None:
    layout = getattr(p, LAYOUT_ATTR, None)
    if layout is None or state.dims.tp == 1:
        return None
    return {"full_shape": list(layout.full_shape), "dim": layout.dim, "parts": layout.parts,
            "transposed": layout.transposed}


def shard_shape(p) -> list[int]:
    return list(getattr(p, "ds_shape", p.shape))


def persistent_buffers(module, named_buffers) -> list:
    """(name, buffer) for the buffers a state dict holds (BatchNorm statistics), of ``named_buffers``."""
    persistent = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in named_buffers if name in persistent]


class IndexFile:
    """One universal file being written: its index entries, and the tensors it holds itself (``key``)
    for the values no engine file holds (``ref``)."""

    def __init__(self):
        self.tensors: dict = {}
        self.index: list[dict] = []

    def add(self, name, kind, start, values, shard_shape, tp_rank, tp_size, layout, ref=None, **extra) -> None:
        entry = {"name": name, "kind": kind, "start": start, "stop": start + values.numel(), "shard_shape": shard_shape,
                 "tp_rank": tp_rank, "tp_size": tp_size, "layout": layout, **extra}
        if ref is not None:
            entry["ref"] = ref
        else:  # fp32 like the masters; buffers keep their dtype
            entry["key"] = f"t{len(self.index)}"
            self.tensors[entry["key"]] = values.to("cpu", torch.float32 if kind != "buffer" else values.dtype).contiguous()
        self.index.append(entry)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.tensors, str(path), metadata={"index": json.dumps(self.index)})


def write_index(io, pieces, buffers, module, optimizer, keys, step, saved=None, scaler=None) -> dict:
    """Write this rank's ``universal/rank<R>.safetensors`` into ``io.folder`` (the staging folder; noted in the save's
    ``checkpoint.io.CheckpointIO``, hashed at the end of the save): the index of ``pieces`` ((name, parameter,
    kind, start, 1-D values)) and ``buffers``, pointing into the engine's own files where ``saved`` locates the
    values, else holding them (buffers, a value the engine did not save as-is). Return the manifest's record
    (``scaler``: the fp16 loss scaler, the same on every rank)."""
    out, tp = IndexFile(), state.dims.tp
    for name, p, kind, start, values in pieces:
        out.add(name, kind, start, values, shard_shape(p), state.coord.tp, tp, layout_of(p),
                ref=saved.locate(values) if saved is not None else None)
    for name, b in buffers:
        out.add(name, "buffer", 0, b.detach().reshape(-1).clone(), list(b.shape), 0, tp, None, dtype=str(b.dtype))
    folder = Path(io.folder) / FOLDER
    if state.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    if state.world_size > 1:
        dist.barrier()
    io.write(folder / f"rank{state.rank}.safetensors", out.save)  # a full disk: kept in io.failures
    groups = [{k: g[k] for k in GROUP_KEYS if k in g} for g in optimizer.param_groups]
    config = getattr(module, "config", None)  # a Hugging Face model's: lets `checkpoint export --to hf` write config.json
    hf_config = (json.loads(config.to_json_string(use_diff=False))
                 if hasattr(config, "to_json_string") and hasattr(module, "save_pretrained") else None)
    return {"state_keys": keys, "step": step, "param_groups": groups, "loss_scaler": scaler_record(scaler),
            "aliases": _aliases(module), "hf_config": hf_config, "model_class": type(module).__name__}


def _aliases(module) -> dict:
    """Tied parameters: every other name -> the name the pieces are stored under."""
    first, out = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out



# -- loss scaler and optimizer state (both engines) -----------------------------------------------
def scaler_fields(scaler) -> dict:
    """The state of one of DeepSpeed's loss scalers (its settings come from the job's options)."""
    return {k: getattr(scaler, k) for k in SCALER_FIELDS if getattr(scaler, k, None) is not None}


def _dynamic(scaler) -> bool:
    # DeepSpeed's DynamicLossScaler says ``dynamic``; its LossScaleConfig (fp16 without ZeRO) ``dynamic_loss_scale``
    return bool(getattr(scaler, "dynamic", getattr(scaler, "dynamic_loss_scale", False)))


def scaler_record(scaler) -> dict | None:
    """A dynamic fp16 loss scaler's state, JSON-ready; None without one (fp32, bf16, a static scale)."""
    if scaler is None or not _dynamic(scaler):
        return None
    return {k: float(v) if k == "cur_scale" else int(v) for k, v in scaler_fields(scaler).items()}


def restore_scaler(scaler, record: dict | None) -> None:
    """Continue a dynamic loss scale where the saving job left it (scale, iterations since the last
    overflow, hysteresis). A static scale, or a job that saved none, keeps this job's options."""
    if scaler is None or record is None or not _dynamic(scaler):
        return
    for k in SCALER_FIELDS:
        if k in record and hasattr(scaler, k):
            setattr(scaler, k, record[k])


def create_missing_state(optimizer, hp_tensors, keys, step) -> None:
    """A torch optimizer creates its state at its first step; a resume happens before it. Create it
    the way torch's Adam-family optimizers would (step, and zeros shaped like the parameter for every
    saved key), so the loaded values have a home (DeepSpeed's ZeRO-3 keeps its fp32 partitions in
    this optimizer's param groups and creates no state of its own before that step)."""
    for hp in hp_tensors:
        st = optimizer.state[hp]
        if not st:
            st["step"] = torch.tensor(float(step or 0), dtype=torch.float32)
            for k in keys:
                st[k] = torch.zeros_like(hp)


def restore_step_and_groups(optimizer, universal: dict) -> None:
    """The step count into every state that has one, and the saved hyperparameters into the param
    groups (when the group count matches: the same optimizer construction)."""
    step = universal.get("step")
    if step is not None:
        for st in optimizer.state.values():
            if "step" in st:
                if torch.is_tensor(st["step"]):
                    st["step"].fill_(step)
                else:
                    st["step"] = type(st["step"])(step)
    saved = universal.get("param_groups") or []
    if len(saved) == len(optimizer.param_groups):
        for group, values in zip(optimizer.param_groups, saved):
            group.update({k: tuple(v) if k == "betas" else v for k, v in values.items()})


# -- read ------------------------------------------------------------------------------------------
class Pieces:
    """Every piece of a universal checkpoint, indexed by (name, kind); tensors read on demand."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        from smp_adapter.runtime.checkpoint.refs import OpenedFiles

        self.deepspeed_files = OpenedFiles(folder)
        self.by_name: dict[tuple[str, str], list[dict]] = {}
        self.handles = {}
        files = sorted((folder / FOLDER).glob("*.safetensors"))
        if not files:
            raise SMPCheckpointError(f"{folder} has no {FOLDER}/ pieces: it was saved by an smp-adapter without "
                                     "layout-independent checkpoints; resume it with the layout it was saved with")
        for path in files:
            handle = safe_open(str(path), framework="pt")
            self.handles[path] = handle
            for entry in json.loads(handle.metadata()["index"]):
                self.by_name.setdefault((entry["name"], entry["kind"]), []).append({**entry, "file": path})

    def read(self, entry) -> torch.Tensor:
        if "ref" in entry:  # a range of one of DeepSpeed's files
            return self.deepspeed_files.read(entry["ref"], entry["stop"] - entry["start"]).float()
        return self.handles[entry["file"]].get_tensor(entry["key"])

    def tp_shard(self, name: str, kind: str, tp_rank: int) -> torch.Tensor:
        """The source TP shard ``tp_rank`` of one parameter, assembled from its pieces."""
        entries = sorted((e for e in self.by_name.get((name, kind), []) if e["tp_rank"] == tp_rank),
                         key=lambda e: e["start"])
        if not entries:
            raise SMPCheckpointError(f"the checkpoint has no {kind} of {name!r} (TP rank {tp_rank}): "
                                     "it was saved from another model, or is incomplete")
        shape = entries[0]["shard_shape"]
        flat = torch.cat([self.read(e) for e in entries])
        if flat.numel() != math.prod(shape) or any(a["stop"] != b["start"] for a, b in zip(entries, entries[1:])):
            raise SMPCheckpointError(f"the pieces of {name!r} ({kind}) do not cover its shard {shape}: "
                                     "a rank's file is missing or truncated")
        return flat.view(shape)

    def full_or_shard(self, name: str, kind: str, p) -> torch.Tensor:
        """The value of ``p``'s TP shard on this rank, from the source's TP shards."""
        entries = self.by_name.get((name, kind))
        if not entries:
            raise SMPCheckpointError(f"the checkpoint has no {kind} of parameter {name!r}: it was saved from "
                                     "another model (or with another optimizer); load the matching model")
        source_layout, source_tp = entries[0]["layout"], entries[0]["tp_size"]
        target_layout = layout_of(p)
        if source_layout == target_layout and (target_layout is None or source_tp == state.dims.tp):
            return self.tp_shard(name, kind, state.coord.tp if target_layout else 0)  # only the bytes needed
        full = self.full(name, kind)
        if target_layout is None:
            return full
        return getattr(p, LAYOUT_ATTR).shard(full, state.coord.tp, state.dims.tp)

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The whole tensor in the original module's layout (TP shards joined)."""
        first = self.by_name[(name, kind)][0]
        layout, tp = first["layout"], first["tp_size"]
        if layout is None:
            return self.tp_shard(name, kind, 0)
        return ShardLayout(tuple(layout["full_shape"]), layout["dim"], layout["parts"],
                           layout["transposed"]).unshard([self.tp_shard(name, kind, t) for t in range(tp)])

    def names(self, kind: str = "param") -> list[str]:
        return [name for name, k in self.by_name if k == kind]
