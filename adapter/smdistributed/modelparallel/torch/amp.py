"""smp.amp.GradScaler: torch's GradScaler on the device smp placed this rank on (spec §2.12).

Overflow detection is per rank: with pp = 1 every rank holds whole layers (or ZeRO shards whose
gradients were already reduced), so the ranks agree without an extra collective."""

import torch


class GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, device=None):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
