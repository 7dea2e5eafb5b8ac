"""The communication ledger: every collective and point-to-point call of a rank, per training step.

With ``SMP_ADAPTER_COMM_LEDGER=DIR`` (``smp-adapter launch --comm-ledger DIR`` sets it) ``smp.init``
installs this ledger and every rank writes ``DIR/rank<r>.jsonl``: one JSON object per training step,
``{"step": i, "ops": [{"group", "ranks", "op", "calls", "bytes", "intra_node"}, ...]}``, and for traffic
outside steps ``{"step": null, "phase": "init" | "eval" | "checkpoint" | "between_steps", "ops": [...]}``.
With pipeline parallelism a step record also holds ``"pipeline": {"wall_s", "busy_s", "schedule",
"bubble"}``: this rank's schedule time, its compute part (runtime/engines/pipeline/idle_time.py) and
the schedule's bubble formula, from which `smp-adapter report` prints each rank's idle fraction.

How every call is seen: the engines (DeepSpeed's comm layer, Megatron-core, torch's pipelining, smp's
own code) all call ``torch.distributed.<name>`` by attribute at call time, and torch's own helpers
(the ``*_object`` collectives, ``batch_isend_irecv``) call the ``distributed_c10d`` module globals. So
the ledger replaces the function in both places, plus any already-imported module attribute that
holds the original function object (a ``from torch.distributed import all_reduce`` copy). A call made
from inside another wrapped call (``all_gather_into_tensor`` -> ``all_gather_single``, the sends of a
``batch_isend_irecv``) is counted once, by the outermost one.

Bytes are the payload as the caller passes it: all_reduce / broadcast / reduce / gather / scatter /
send / recv: the tensor; all_gather*: the output; reduce_scatter* and all_to_all*: the input.

A training step is the traffic from the first ``@smp.step`` call after an optimizer step (or from the
start) up to the end of the next ``DistributedOptimizer.step``, so several step calls of gradient
accumulation are one step and the gradient reduction DeepSpeed does in ``step()`` belongs to it. An
``@smp.step`` call without gradients (``torch.no_grad()`` or ``model.eval()``) outside a training step
is phase "eval". Off (the variable unset), nothing is installed: no wrapper, no cost.

Nothing is lost when a rank leaves by ``os._exit`` (no atexit handlers run): a step's record is
written when the step ends, and the record of traffic outside steps is rewritten in place after
every call, so the file always holds everything counted up to the last call outside a step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from pathlib import Path

ENV = "SMP_ADAPTER_COMM_LEDGER"

# torch.distributed function -> (op family recorded, the argument holding the payload)
PAYLOAD_ARGUMENT = {
    "all_reduce": ("all_reduce", "tensor"), "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"), "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor_list"), "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"), "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "reduce_scatter": ("reduce_scatter", "input_list"), "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"), "all_to_all": ("all_to_all", "input_tensor_list"),
    "gather": ("gather", "tensor"), "scatter": ("scatter", "tensor"),
    "send": ("send", "tensor"), "isend": ("send", "tensor"), "recv": ("recv", "tensor"), "irecv": ("recv", "tensor"),
    "barrier": ("barrier", None), "monitored_barrier": ("barrier", None),
}
# torch.distributed's positional parameters (its public signatures, torch 2.x), so that a call is read the
# same way when the function was already wrapped by someone else with a (*args, **kwargs) signature
PARAMETERS = {
    "all_reduce": ("tensor", "op", "group"), "all_reduce_coalesced": ("tensors", "op", "group"),
    "broadcast": ("tensor", "src", "group"), "reduce": ("tensor", "dst", "op", "group"),
    "all_gather": ("tensor_list", "tensor", "group"), "all_gather_coalesced": ("output_tensor_lists", "input_tensor_list", "group"),
    "reduce_scatter": ("output", "input_list", "op", "group"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group"),
    "gather": ("tensor", "gather_list", "dst", "group"), "scatter": ("tensor", "scatter_list", "src", "group"),
    "send": ("tensor", "dst", "group"), "isend": ("tensor", "dst", "group"),
    "recv": ("tensor", "src", "group"), "irecv": ("tensor", "src", "group"),
    "barrier": ("group",), "monitored_barrier": ("group",),
    **{name: ("output_tensor", "input_tensor", "group") for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")},
    **{name: ("output", "input", "op", "group") for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")},
}
P2P_OPS = ("send", "recv")
# smp group kinds, most specific first: a process group is named after the first whose ranks it has
KIND_ORDER = ("tp", "pp", "sdp", "replicate", "rdp", "dp", "mp", "world")
# modules whose attributes may hold copies of torch.distributed's functions (bound at their import)
PATCHED_PACKAGES = ("torch.distributed", "deepspeed", "megatron", "smp_adapter", "smdistributed")

_active: "Ledger | None" = None


def payload_bytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    numel = getattr(value, "numel", None)
    return numel() * value.element_size() if numel is not None else 0


class Ledger:
    """One rank's counts: (group name, ranks, op, intra_node) -> [calls, bytes], flushed per record."""

    def __init__(self, path: Path, rank: int, kind_ranks: dict[str, tuple[int, ...]], node_size: int):
        self.path, self.rank, self.node_size = path, rank, max(1, node_size)
        self.kind_ranks = kind_ranks  # smp group kind -> this rank's group, ascending global ranks
        self.file = open(path, "wb")
        self.record_start = 0  # file offset of the record still being counted (rewritten in place)
        self.counts: dict[tuple, list[int]] = {}
        self.timing: dict | None = None  # the pipeline engine's schedule time in this step (summed over calls)
        self.step = 0
        self.in_step = False
        self.phase = "init"
        self._group_cache: dict = {}
        self._depth = threading.local()
        self.patched: list[tuple[object, str, object]] = []  # (module, name, original) to restore

    # -- naming ----------------------------------------------------------------------------------
    def _name(self, ranks: tuple[int, ...]) -> str:
        if len(ranks) == 1:
            return "self"
        for kind in KIND_ORDER:
            if self.kind_ranks.get(kind) == ranks:
                return kind
        return "other"

    def _p2p_name(self, ranks: tuple[int, ...]) -> str:
        """A point-to-point link is named after the smallest smp group holding both ends (pp for
        the pipeline's activations), whatever group object the caller passed."""
        for kind in KIND_ORDER:
            members = self.kind_ranks.get(kind)
            if members is not None and set(ranks) <= set(members):
                return kind
        return "other"

    def _group_ranks(self, group) -> tuple[int, ...]:
        import torch.distributed as dist

        key = group if group is not None else dist.group.WORLD
        cached = self._group_cache.get(key)
        if cached is None:
            cached = self._group_cache[key] = tuple(sorted(dist.get_process_group_ranks(key)))
        return cached

    def _intra(self, ranks) -> bool:
        return len({r // self.node_size for r in ranks}) == 1

    # -- counting --------------------------------------------------------------------------------
    def add(self, op: str, ranks: tuple[int, ...], nbytes: int, p2p: bool = False) -> None:
        name = self._p2p_name(ranks) if p2p else self._name(ranks)
        key = (name, ranks, op, self._intra(ranks))
        entry = self.counts.get(key)
        if entry is None:
            self.counts[key] = [1, nbytes]
        else:
            entry[0] += 1
            entry[1] += nbytes
        if not self.in_step:
            # outside steps the record is on disk after every call: a rank that leaves by os._exit
            # (no atexit, as forked workers and some launchers do) loses none of its phase traffic.
            # In a step only the step's end writes (the hot path pays nothing).
            self._write(final=False)

    def record_call(self, fname: str, bound: dict) -> None:
        op, argument = PAYLOAD_ARGUMENT[fname]
        group = bound.get("group")
        if op in P2P_OPS:
            peer = bound.get("dst" if op == "send" else "src")
            group_peer = bound.get("group_dst" if op == "send" else "group_src")
            if peer is None and group_peer is not None:
                import torch.distributed as dist

                peer = dist.get_global_rank(group if group is not None else dist.group.WORLD, group_peer)
            self.add(op, tuple(sorted({self.rank, int(peer)})), payload_bytes(bound.get(argument)), p2p=True)
            return
        nbytes = payload_bytes(bound.get(argument)) if argument else 0
        self.add(op, self._group_ranks(group), nbytes)

    def record_batch(self, ops) -> None:
        for p2p in ops:
            op = "send" if "send" in p2p.op.__name__ else "recv"
            self.add(op, tuple(sorted({self.rank, int(p2p.peer)})), payload_bytes(p2p.tensor), p2p=True)

    # -- records ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what was counted as one record (a step's record even when it moved nothing)."""
        if not self.counts and not self.in_step:
            return
        self._write(final=True)
        self.counts = {}

    def _write(self, final: bool) -> None:
        """(Re)write the current record at record_start; a final one is followed by the next record."""
        ops = [{"group": name, "ranks": list(ranks), "op": op, "calls": calls, "bytes": nbytes, "intra_node": intra}
               for (name, ranks, op, intra), (calls, nbytes) in sorted(self.counts.items())]
        record = {"step": self.step, "ops": ops} if self.in_step else {"step": None, "phase": self.phase, "ops": ops}
        if self.in_step and self.timing is not None:
            record["pipeline"] = self.timing
        self.file.seek(self.record_start)
        self.file.write((json.dumps(record) + "\n").encode())
        self.file.truncate()
        self.file.flush()  # to the kernel: survives os._exit
        if final:
            self.record_start = self.file.tell()
            if self.in_step:
                self.timing = None  # the step's schedule time went into its record

    def step_call(self, training: bool) -> None:
        if self.in_step:
            return
        if training:
            self.flush()
            self.in_step = True
        elif self.phase != "eval":
            self.flush()
            self.phase = "eval"

    def optimizer_step_done(self) -> None:
        if self.in_step:
            self.flush()
            self.in_step = False
            self.step += 1
        elif self.phase != "between_steps":  # an optimizer step without a step call: its traffic
            self.flush()
        self.phase = "between_steps"

    def set_phase(self, name: str) -> str:
        previous = self.phase
        if not self.in_step and name != self.phase:
            self.flush()
            self.phase = name
        return previous

    def close(self) -> None:
        if not self.file.closed:
            self.flush()
            self.file.close()

    # -- wrapping ----------------------------------------------------------------------------------
    def wrap(self, fname: str, original):
        names = PARAMETERS.get(fname, ())
        depth = self._depth
        batch = fname == "batch_isend_irecv"

        @functools.wraps(original)
        def counted(*args, **kwargs):
            level = getattr(depth, "value", 0)
            if level == 0:  # the outermost wrapped call counts; the calls it makes do not
                if batch:
                    self.record_batch(args[0] if args else kwargs["p2p_op_list"])
                else:
                    self.record_call(fname, {**dict(zip(names, args)), **kwargs})
            depth.value = level + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.value = level

        counted.__smp_ledger_original__ = original
        return counted

    def install(self) -> None:
        import sys

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        replacements = {}  # id(original) -> wrapper
        for fname in (*PAYLOAD_ARGUMENT, "batch_isend_irecv"):
            original = getattr(c10d, fname, None)
            if original is None:
                continue
            wrapper = self.wrap(fname, original)
            replacements[id(original)] = wrapper
            public = getattr(dist, fname, None)
            if public is not None and public is not original:  # someone wrapped the public name only
                replacements[id(public)] = self.wrap(fname, public)
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(PATCHED_PACKAGES) or name == __name__:
                continue
            for attr, value in list(vars(module).items()):
                wrapper = replacements.get(id(value)) if callable(value) else None
                if wrapper is not None and getattr(wrapper, "__smp_ledger_original__", None) is value:
                    self.patched.append((module, attr, value))
                    setattr(module, attr, wrapper)

    def uninstall(self) -> None:
        for module, attr, original in reversed(self.patched):
            setattr(module, attr, original)
        self.patched = []


# -- what the runtime calls ------------------------------------------------------------------------
def install_if_requested(dims, rank: int, local_size: int) -> None:
    """At smp.init, after the groups exist: start the ledger when SMP_ADAPTER_COMM_LEDGER names a directory."""
    global _active
    directory = os.environ.get(ENV, "")
    if not directory or _active is not None:
        return
    from smp_adapter.errors import SMPUsageError

    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"rank{rank}.jsonl"
        kinds = {kind: tuple(getattr(dims.grid, f"{kind}_group")(rank)) for kind in ("tp", "pp", "rdp", "dp", "mp")}
        kinds["world"] = tuple(range(dims.world_size))
        if dims.hpz_partition_size > 1 or dims.mics_group_size > 1:
            kinds["sdp"] = next(g for g in dims.grid.sdp_groups(dims.sdp) if rank in g)
        if dims.mics_group_size > 1:  # MiCS's all-reduce across the groups
            kinds["replicate"] = next(g for g in dims.grid.sdp_replica_groups(dims.sdp) if rank in g)
        ledger = Ledger(path, rank, kinds, node_size=local_size)
    except OSError as exc:
        raise SMPUsageError(f"{ENV}={directory}: cannot write the communication ledger there ({exc.strerror}): "
                            "give a writable directory, or unset the variable") from None
    ledger.install()
    _active = ledger
    import atexit

    atexit.register(close)


def is_on() -> bool:
    return _active is not None


def close() -> None:
    """Write what is pending, restore torch.distributed's functions (smp.shutdown and exit)."""
    global _active
    ledger, _active = _active, None
    if ledger is not None:
        ledger.uninstall()
        ledger.close()


def note_step_call(model) -> None:
    if _active is not None:
        import torch

        _active.step_call(torch.is_grad_enabled() and (model is None or getattr(model, "training", True)))


def note_step_timing(timing: dict | None) -> None:
    """The pipeline engine's (wall, compute) seconds of a training step call, recorded with the step."""
    if _active is not None and timing is not None and _active.in_step:
        previous = _active.timing
        if previous is not None:  # gradient accumulation: several step calls per optimizer step
            timing = {**timing, "wall_s": previous["wall_s"] + timing["wall_s"],
                      "busy_s": previous["busy_s"] + timing["busy_s"]}
        _active.timing = timing


def note_optimizer_step() -> None:
    if _active is not None:
        _active.optimizer_step_done()


@contextlib.contextmanager
def phase(name: str):
    """Traffic inside the block (outside a training step) is recorded under phase ``name``."""
    if _active is None:
        yield
        return
    previous = _active.set_phase(name)
    try:
        yield
    finally:
        if _active is not None:
            _active.set_phase(previous)
