"""Host-to-device copies that do not block the host, and device identity."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
    """``t.to(device)``; with ``non_blocking`` a CPU tensor bound for CUDA is pinned first, so the copy
    is asynchronous (the caching host allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if non_blocking and t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def on_device(where: torch.device, device: torch.device) -> bool:
    """Whether a tensor on ``where`` lives on ``device``, where ``device`` may carry no index.

    ``torch.device("cuda") == torch.device("cuda:0")`` is False, but every CUDA tensor reports an index: a
    plain comparison of ``tensor.device`` with an index-less device (what ``accelerate`` and
    ``pick_device`` may hand out) matches nothing. An index-less ``device`` matches every index of its
    type (one process holds its tensors on one device of a type); with an index, the indices must agree.

    Example: ``on_device(torch.device("cuda:0"), torch.device("cuda"))`` → True;
    ``on_device(torch.device("cuda:1"), torch.device("cuda:0"))`` → False; ``on_device(cpu, cuda)`` → False.
    """
    where, device = torch.device(where), torch.device(device)
    return where.type == device.type and (device.index is None or where.index == device.index)
