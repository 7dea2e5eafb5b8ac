"""smp.amp: ``GradScaler`` consistent across pipeline stages and TP ranks (smp_adapter.runtime.grad_scaler)."""

from smp_adapter.runtime.grad_scaler import GradScaler

__all__ = ["GradScaler"]
