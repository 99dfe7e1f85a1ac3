"""Scalars for the experiment trackers (tensorboard, wandb) and memory readings."""
from __future__ import annotations

import torch


def peak_memory() -> dict:
    """Peak memory so far: ``peak_mem_gb`` (CUDA max allocated, GiB) on GPU; always ``peak_rss_gb``
    (this process's peak resident set, GiB, from ``getrusage``; KiB on Linux)."""
    import resource

    out = {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def flat_metrics(rec: dict, prefix: str) -> dict[str, float]:
    """Scalars for the trackers: ``{prefix}/{key}``; per-depth lists become ``{key}_d{depth}``, the
    ``eval_sim_al`` dict ``sim_al_k{K}``; booleans and strings are dropped.

    Example: ``flat_metrics({"loss": 1.0, "acc": [0.5, 0.25]}, "train")`` →
    ``{"train/loss": 1.0, "train/acc_d0": 0.5, "train/acc_d1": 0.25}``.
    """
    out = {}
    for k, v in rec.items():
        name = k[len("eval_"):] if k.startswith("eval_") else k
        if isinstance(v, bool) or isinstance(v, str):
            continue
        if isinstance(v, (int, float)):
            out[f"{prefix}/{name}"] = float(v)
        elif isinstance(v, list):
            out.update({f"{prefix}/{name}_d{d}": float(x) for d, x in enumerate(v)})
        elif isinstance(v, dict):
            out.update({f"{prefix}/{name}_k{kk}": float(x) for kk, x in v.items()})
    return out
