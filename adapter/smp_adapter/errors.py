"""One error hierarchy for everything smp-adapter raises on purpose.

Every message names the problem and the fix. ``SMPConfigError`` carries *all* problems found
in one configuration, one per line, so a user fixes a config in one round trip.
"""

from __future__ import annotations


class SMPAdapterError(Exception):
    """Base class of every error smp-adapter raises deliberately."""


class SMPConfigError(SMPAdapterError, ValueError):
    """Invalid smp options or SageMaker distribution dict.

    ``problems`` is the list of ``ConfigProblem``s; ``str(err)`` lists them all.
    """

    def __init__(self, problems, partial=None):
        self.problems = list(problems)
        # the options without the keys whose values were invalid (an SMPConfig, or None): what the layout
        # rules can still be checked on, so that one message lists every problem (dims.with_layout_problems)
        self.partial = partial
        lines = [f"  - {p}" for p in self.problems]
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid smp configuration ({len(self.problems)} {noun}):\n" + "\n".join(lines))

    @property
    def keys(self):
        return [p.key for p in self.problems]


class UnsupportedFeatureError(SMPAdapterError, NotImplementedError):
    """A documented smp feature that smp-adapter does not carry out (yet); says what to use instead."""


class NotInitializedError(SMPAdapterError, RuntimeError):
    """The smp API was used before ``smp.init()``."""


class SMPUsageError(SMPAdapterError, RuntimeError):
    """The smp API was called in a way the library does not allow (wrong order, wrong place)."""


class SMPCheckpointError(SMPAdapterError, RuntimeError):
    """A checkpoint is missing, incomplete, not a checkpoint, or saved with another layout."""


class SMPCommError(SMPAdapterError, RuntimeError):
    """A collective failed or timed out, usually because another rank died."""
