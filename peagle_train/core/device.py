"""Host-to-device copies that do not block the host."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
    """``t.to(device)``; with ``non_blocking`` a CPU tensor bound for CUDA is pinned first, so the copy
    is asynchronous (the caching host allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if non_blocking and t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
