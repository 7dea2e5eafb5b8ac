"""smdistributed.modelparallel, as provided by smp-adapter (an open-source stand-in for
SageMaker's model parallelism library v1). ``__version__`` reports the last v1 release whose API
smp-adapter follows, so scripts that check ``>= 1.x`` keep working."""

__version__ = "1.15.0"
ADAPTER = "smp-adapter"
