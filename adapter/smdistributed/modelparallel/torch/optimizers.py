"""smp.optimizers: the apex fused optimizers smp v1 shipped (FusedLAMB, FusedAdam).

FusedAdam is torch's AdamW (its fused kernel on CUDA). FusedLAMB / FusedLamb / FusedNovoGrad follow
apex's definitions in plain PyTorch on every device: smp_adapter/compat/fused_optimizers.py (also
behind ``apex.optimizers`` where NVIDIA apex is not installed: smp_adapter/compat/apex_fallback)."""

from smp_adapter.compat.fused_optimizers import FusedAdam, FusedLAMB, FusedNovoGrad

FusedLamb = FusedLAMB

__all__ = ["FusedAdam", "FusedLAMB", "FusedLamb", "FusedNovoGrad"]
