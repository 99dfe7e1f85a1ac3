"""torch.compile's compiled code carried between launches (``train.compile_cache``).

A run that stops under a job's time limit and resumes on a fresh machine compiles everything again: the
drafter's layers and loss chunks, the online target's layers, FlexAttention's kernels for each grid size.
On an H100 that was about a minute of a 5-minute SmolLM2 run (docs/results.md, run 6). torch's portable
cache (:func:`torch.compiler.save_cache_artifacts` / :func:`torch.compiler.load_cache_artifacts`: Inductor's
FX graphs, AOTAutograd's graphs, Triton kernels, autotuning results) lets the next launch hit those compiles
instead of running them, on any machine with the same GPU kind and torch / Triton versions; Dynamo still
traces the Python, which is quick. The file is opaque bytes written atomically; a file another torch cannot
read is ignored with a warning (the run compiles as if it were absent).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from peagle_train.core.atomic import write_bytes_atomic


def compile_cache_path(setting: str | None, output_dir: str | Path) -> Path | None:
    """``train.compile_cache`` as a path: None stays None, a relative path is under ``output_dir``."""
    if setting is None:
        return None
    p = Path(setting).expanduser()
    return p if p.is_absolute() else Path(output_dir) / p


def _counts(info) -> dict[str, int]:
    """Artifacts per kind (``inductor``, ``aot_autograd``, ``autotune``, ...) of a torch ``CacheInfo``."""
    return {k: len(v) for k, v in getattr(info, "artifacts", {}).items() if v}


def load_compile_cache(path: Path | None) -> dict | None:
    """Give torch the compiled code in ``path`` before anything compiles.

    Returns:
        None when ``path`` is None or absent; else ``{"bytes", "artifacts": {kind: count}}``, or
        ``{"bytes", "error"}`` when torch could not read it (a warning says so; the run compiles afresh).
    """
    if path is None or not path.is_file():
        return None
    data = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(data)
        why = None if info is not None else "torch returned nothing (damaged, or another torch's format)"
    except Exception as e:  # noqa: BLE001 -- another torch's format: compiling afresh is the right fallback
        info, why = None, f"{type(e).__name__}: {str(e)[:200]}"
    if why is not None:
        warnings.warn(f"train.compile_cache {path}: torch could not read it ({why}); compiling afresh (the file "
                      "is written again at the end of this launch)", stacklevel=2)
        return {"bytes": len(data), "error": why}
    return {"bytes": len(data), "artifacts": _counts(info)}


def save_compile_cache(path: Path | None) -> dict | None:
    """Write the compiled code this process made or loaded so far to ``path`` (atomically).

    Returns:
        None when ``path`` is None or torch has nothing to save (nothing was compiled); else
        ``{"bytes", "artifacts": {kind: count}}``.
    """
    if path is None:
        return None
    res = torch.compiler.save_cache_artifacts()
    if res is None:
        return None
    data, info = res
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, data)
    return {"bytes": len(data), "artifacts": _counts(info)}


__all__ = ["compile_cache_path", "load_compile_cache", "save_compile_cache"]
