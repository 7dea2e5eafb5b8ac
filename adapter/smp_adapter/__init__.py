"""smp-adapter: SageMaker model parallelism v1 scripts on DeepSpeed and Megatron-core.

The import name of the user-facing API is ``smdistributed.modelparallel.torch``; this package
holds the implementation. Importing it (or its ``config``/``translate`` layers) never imports
deepspeed, megatron or torch.distributed: engines are imported lazily where they are used.
"""

__version__ = "0.1.0"
