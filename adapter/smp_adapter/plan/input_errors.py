"""Bad input to ``smp-adapter plan``, labelled by what is really wrong.

smp options get the config layer's ``SMPConfigError`` ("invalid smp configuration"). Everything
else plan reads is not an smp configuration: a model config file, a model family, an instance type,
a command-line figure. Each gets this error instead, whose first words name that thing, followed by
the config layer's one-line problem format (``key = value: what is wrong. Fix: what to do``). The
CLI prints it and exits 2, like every ``SMPAdapterError``.
"""

from __future__ import annotations

from smp_adapter.config.problems import MISSING, ConfigProblem
from smp_adapter.errors import SMPAdapterError


class PlanInputError(SMPAdapterError, ValueError):
    """One bad input to plan: ``label`` names the thing (e.g. "model config file")."""

    def __init__(self, label: str, key: str, message: str, fix: str, value=MISSING):
        self.label = label
        self.problem = ConfigProblem(key, message, fix, value)
        super().__init__(f"{label}: {self.problem}")
