"""smp-adapter: SageMaker model parallelism v1 scripts on DeepSpeed, torch FSDP2, Megatron-core and torch pipelining.

The import name of the user-facing API is ``smdistributed.modelparallel.torch``; this package
holds the implementation. Importing it (or its ``config``/``translate`` layers) never imports
deepspeed, megatron or torch.distributed: engines are imported lazily where they are used.
"""

__version__ = "0.1.0"

_shutdown_resets: list = []


def on_shutdown(reset):
    """Register ``reset`` (no arguments) to run at every ``smp.shutdown()``: each process-wide value
    outside ``runtime/state.py`` registers its reset where it is defined (used as a decorator), so
    shutdown needs no list of modules. Only imported modules register: what was never imported
    holds nothing to reset."""
    _shutdown_resets.append(reset)
    return reset


def run_shutdown_resets() -> None:
    for reset in _shutdown_resets:
        reset()
