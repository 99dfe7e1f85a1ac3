"""fp8 storage of feature rows: float8_e4m3fn with one float32 scale per row (per token).

``q = round_e4m3(x / s)``, ``s = amax(|x|) / 448`` over each row's values (448 = the largest
finite float8_e4m3fn; a zero row gets ``s = 1``), the per-token scaling used for fp8
activations (vLLM / TransformerEngine). Used by the feature cache (:mod:`peagle_train.features.cache`).
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8_rows(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantisation.

    Args:
        x: ``[n, G*D]`` floating tensor; each row is split into ``groups`` (G) blocks of D.
        groups: blocks per row, each with its own scale (A for aux states, 1 for ``last``).

    Returns:
        ``(q [n, G*D] float8_e4m3fn, scale [n, G] float32)`` with
        ``x ≈ q.float().view(n, G, D) * scale[..., None]``; ``scale = amax / 448`` per block
        (1 for an all-zero block). Relative error per element is at most 2^-4 of its own
        magnitude for normal e4m3 values (3 mantissa bits), absolute at most
        ``scale * 2^-9`` near zero (e4m3 subnormal spacing).

    Raises:
        ValueError: ``x`` not 2-D or its width not divisible by ``groups``.
    """
    if x.dim() != 2 or x.shape[1] % groups:
        raise ValueError(f"quantize_fp8_rows: expected [n, G*D] with G={groups}, got {tuple(x.shape)}")
    n = x.shape[0]
    xf = x.detach().to(torch.float32).view(n, groups, -1)
    amax = xf.abs().amax(-1)  # [n, G]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, -1), scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_rows`: ``[n, G*D]`` fp8 and ``[n, G]`` float32 → ``[n, G*D]`` ``out_dtype``."""
    n, g = scale.shape
    return (q.to(torch.float32).view(n, g, -1) * scale[..., None]).view(n, -1).to(out_dtype)
