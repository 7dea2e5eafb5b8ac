"""A single configuration problem: key, value given, what is allowed, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MISSING = object()


@dataclass(frozen=True)
class ConfigProblem:
    key: str
    message: str  # what is wrong and what is allowed
    fix: str  # what to write instead
    value: Any = MISSING

    def __str__(self) -> str:
        from smp_adapter.config.limits import quote

        given = "" if self.value is MISSING else f" = {quote(self.value)}"  # a short prefix of any value
        return f"{self.key}{given}: {self.message}. Fix: {self.fix}"


def raise_if_any(problems, partial=None):
    """Raise one SMPConfigError listing every problem (``partial``: SMPConfigError.partial), or return quietly."""
    if problems:
        from smp_adapter.errors import SMPConfigError

        raise SMPConfigError(problems, partial)
