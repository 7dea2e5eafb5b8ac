"""Process-wide smp state: what ``smp.init`` resolved, and the objects later calls need.

``smp.state`` in user scripts is the ``state`` object below; ``smp.state.cfg`` is the effective
SMPConfig (attribute names = smp key names), as smp v1 scripts read ``smp.state.cfg.fp16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smp_adapter.errors import NotInitializedError, UnsupportedFeatureError

warned: set[str] = set()  # what warn_once has said since smp.init (cleared by State.reset)


def warn_once(messages, rank: int) -> None:
    """Each message once per smp.init .. shutdown, from rank 0 only (the job's log is not N copies)."""
    import warnings

    for message in messages:
        if message not in warned:
            warned.add(message)
            if rank == 0:
                warnings.warn(message, stacklevel=3)


@dataclass
class StepProgress:
    """Where the job's steps are: written by ``@smp.step`` (runtime/step.py), read by the engines, which
    are handed this one object when smp.init creates them (these facts change during a job, unlike the
    frozen ``Job``, so an engine holds the live object rather than a copy)."""

    in_step: bool = False  # inside an @smp.step call
    microbatch: int | None = None  # index of the microbatch being run
    step_calls: int = 0  # completed @smp.step calls (for backward_passes_per_step)


@dataclass
class ProcessGroups:
    """torch.distributed process groups of the caller, one per smp group kind."""

    world: Any = None
    tp: Any = None
    pp: Any = None
    rdp: Any = None
    dp: Any = None
    mp: Any = None
    sdp: Any = None  # sdp < rdp size (hpZ or MiCS): this rank's sharding group, a chunk of its RDP group
    sdp_replicas: Any = None  # MiCS only: the ranks at this rank's place in every chunk of its RDP group
    objects: Any = None  # gloo group over the world for pickled-object collectives (NCCL jobs too)


class ModuleManager:
    """What transformers reads on its SageMaker-MP path (``smp.state.module_manager``): pairs of
    (smp -> HF, HF -> smp) state-dict translations. Our smp format *is* the HF format: none."""

    translate_functions: list = []


# smp < 1.10 had no fp16 option: scripts (the DLC GPT-2 test's fp16/ helpers) wrapped their own
# apex-style FP16_Optimizer around smp and read smp's internal maps. That path has no equivalent here.
PRE_1_10_FP16 = ("smp < 1.10's fp16 path (an apex-style FP16_Optimizer over smp internals, as in the DLC GPT-2 "
                 "script's fp16/ helpers) has no equivalent in smp-adapter: set fp16: true (or bf16: true) in the "
                 "smp options and wrap the torch optimizer itself in smp.DistributedOptimizer")
PRE_1_10_STATE_NAMES = ("param_index_to_name_tp_group", "param_name_to_index_tp_group")


class State:
    def __getattr__(self, name):  # only for names the instance does not have
        if name in PRE_1_10_STATE_NAMES:
            raise UnsupportedFeatureError(f"smp.state.{name}: {PRE_1_10_FP16}")
        raise AttributeError(f"smp.state has no attribute {name!r}")

    def __init__(self):
        self.module_manager = ModuleManager()
        self.reset()

    def reset(self) -> None:
        warned.clear()
        self.initialized = False
        self._cfg = None
        self.dims = None  # ParallelDims
        self.engine = None  # the job's one Engine instance, created by smp.init from the layout (runtime/engines)
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_size = 1
        self.backend = None
        self.device = None
        self.groups = ProcessGroups()
        self.model = None  # the one DistributedModel of this script
        self.optimizer = None  # the DistributedOptimizer
        self.progress = StepProgress()  # in_step, microbatch, step_calls: shared with the engine
        self.tracing = False
        self.launcher = None
        self.owns_process_group = False
        self.environ_changes: dict = {}  # variable -> value before smp.init (None: unset), restored by shutdown
        self.failed = False  # an uncaught exception reached sys.excepthook (runtime/init.py)

    @property
    def cfg(self):
        if self._cfg is None:
            raise NotInitializedError("smp.state.cfg is only available after smp.init(): call smp.init() first")
        return self._cfg

    @cfg.setter
    def cfg(self, value) -> None:
        self._cfg = value

    @property
    def coord(self):
        return self.dims.grid.coord(self.rank)


state = State()


def require_initialized(api: str) -> State:
    if not state.initialized:
        raise NotInitializedError(
            f"smp.{api}() was called before smp.init(): call smp.init() at the start of the script, "
            "before any other smp call")
    return state
