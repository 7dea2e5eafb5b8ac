"""``smdistributed.modelparallel.torch.state_mod.state``: the same object as ``smp.state`` (the AWS
fp16 helpers import it from here)."""

from smp_adapter.runtime.state import state

__all__ = ["state"]
