"""Exception classes the SageMaker training toolkit looks up to classify user-script errors."""

from smp_adapter.errors import (  # noqa: F401
    NotInitializedError,
    SMPAdapterError,
    SMPCheckpointError,
    SMPCommError,
    SMPConfigError,
    SMPUsageError,
    UnsupportedFeatureError,
)

SMPValidationError = SMPConfigError

__all__ = ["NotInitializedError", "SMPAdapterError", "SMPCheckpointError", "SMPCommError", "SMPConfigError",
           "SMPUsageError", "UnsupportedFeatureError", "SMPValidationError"]
