"""Scalars for the experiment trackers (tensorboard, wandb) and memory readings."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from peagle_train.core.config import ConfigError


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
    ``eval_sim_al`` dict ``sim_al_k{K}``, the ``eval_walk_al_sets`` dict of dicts ``walk_al_sets_{set}_k{K}``;
    booleans and strings are dropped.

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
            for kk, x in v.items():
                if isinstance(x, dict):  # eval_walk_al_sets: {set: {K: AL}} -> walk_al_sets_{set}_k{K}
                    out.update({f"{prefix}/{name}_{kk}_k{k2}": float(y) for k2, y in x.items()})
                else:
                    out[f"{prefix}/{name}_k{kk}"] = float(x)
    return out


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def prepare_trackers(report_to: list[str], logging_dir: str | Path) -> list[str]:
    """Trackers for ``Accelerator(log_with=...)``; wandb is imported lazily and runs offline without credentials.

    Sets ``WANDB_MODE=offline`` (unless already set) when neither ``WANDB_API_KEY`` nor a
    ``~/.netrc`` entry for ``api.wandb.ai`` exists, and ``WANDB_DIR`` to ``logging_dir``.

    Raises:
        ConfigError: ``train.report_to`` names wandb and the package is not installed.
    """
    if "wandb" in report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("train.report_to includes 'wandb' but the wandb package is not installed: "
                              "pip install 'peagle-train[wandb]' (or remove wandb from train.report_to)") from None
        if not _wandb_credentials():
            os.environ.setdefault("WANDB_MODE", "offline")
        Path(logging_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(logging_dir))
    return list(report_to)
