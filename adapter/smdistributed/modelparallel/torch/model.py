"""``smp.model.DistributedModel``: the module path transformers' Trainer checks with isinstance."""

from smp_adapter.runtime.model import DistributedModel  # noqa: F401
