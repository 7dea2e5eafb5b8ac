"""smp.nn: tensor-parallel modules (spec §2.10), implemented on Megatron-core layers."""


def __getattr__(name):
    from smp_adapter.parallel import nn as _impl

    try:
        return getattr(_impl, name)
    except AttributeError:
        raise AttributeError(f"smp.nn has no attribute {name!r}") from None
