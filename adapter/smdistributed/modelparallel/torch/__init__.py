"""``import smdistributed.modelparallel.torch as smp`` - the smp v1 API, carried out by DeepSpeed
engines and Megatron-core layers (implementation: the ``smp_adapter`` package).

Every public name of smp v1's smdistributed.modelparallel.torch is exported here; tests/unit/test_api_surface.py pins the list.
"""

from smp_adapter.errors import UnsupportedFeatureError as _Unsupported
from smp_adapter.runtime.checkpoint.save_load import load, save
from smp_adapter.runtime.checkpoint.dirs import resume_from_checkpoint, save_checkpoint
from smp_adapter.runtime.comm import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_rank,
    tp_size,
)
from smp_adapter.runtime.init import init
from smp_adapter.runtime.memory import (
    delay_param_initialization,
    model_creation,
    register_parameter,
    set_activation_checkpointing,
)
from smp_adapter.runtime.model import DistributedModel
from smp_adapter.runtime.optimizer import DistributedOptimizer
from smp_adapter.runtime.state import state
from smp_adapter.runtime.step import StepOutput, step

from . import amp, exceptions, model, nn, optimizers, patches  # noqa: F401  (nn resolves its classes lazily)
from .patches import checkpoint as _checkpoint  # noqa: F401  (smp.patches.checkpoint)


def is_initialized() -> bool:
    return state.initialized


def is_tracing() -> bool:
    """smp-adapter runs no tracing pass (stages come from parameter sizes), so never True."""
    return False


def partition(index: int):
    """Manual pipeline stage assignment: only meaningful with pipeline parallelism."""
    from smp_adapter.runtime.partition import partition as _partition

    return _partition(index)


def set_partition(module, partition: int) -> None:
    from smp_adapter.runtime.partition import set_partition as _set_partition

    return _set_partition(module, partition)


def _marking(name):
    def call(*args, **kwargs):
        try:
            from smp_adapter.parallel import marking
        except ImportError:  # pragma: no cover - tensor parallel engine missing from the build
            raise _Unsupported(f"smp.{name} needs the tensor-parallel engine (smp_adapter.parallel), which is "
                               "missing from this installation: reinstall smp-adapter") from None
        return getattr(marking, name)(*args, **kwargs)

    call.__name__ = name
    return call


tensor_parallelism = _marking("tensor_parallelism")
set_tensor_parallelism = _marking("set_tensor_parallelism")
tp_register = _marking("tp_register")
tp_register_with_module = _marking("tp_register_with_module")

