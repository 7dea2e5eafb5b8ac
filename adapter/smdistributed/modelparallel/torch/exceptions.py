"""Exception classes the SageMaker training toolkit looks up to classify user-script errors
(the same hierarchy as smdistributed.modelparallel.backend.exceptions)."""

from smdistributed.modelparallel.backend.exceptions import *  # noqa: F401,F403
from smdistributed.modelparallel.backend.exceptions import SMPValidationError, UnsupportedFeatureError  # noqa: F401
