"""Decoding attention for grouped-query targets without copying the KV cache (regeneration, engine
``static``).

transformers' SDPA attention (``integrations.sdpa_attention``) expands the grouped key/value heads to
one per query head (``repeat_kv``) whenever an attention mask is given on CUDA, because PyTorch's
masked kernels take no grouped heads. A left-padded batch over a static KV cache always has a mask, so
every decoding step copies the whole cache ``H / Hkv`` times (3× for SmolLM2: 9 query heads, 3 KV
heads) and then reads the copy: at a batch of 512 over a 2,560-position cache that is, by count (not
measured), ~120 GB of memory traffic per step for a 135M-parameter model (docs/benchmarks.md, "Regeneration on one H200").

A decoding step has one query per head, so the query heads that share a key/value head can stand in
for query *positions* instead: ``[B, H, 1, d]`` is viewed as ``[B, Hkv, H/Hkv, d]`` and attends to
``[B, Hkv, L, d]`` under the same per-key mask. Query head ``h`` uses key/value head ``h // (H/Hkv)``
(transformers' ``repeat_kv`` order), so the result is the same attention, computed with no copy.
Prefill (several queries), per-head masks, attention sinks or dropout go to transformers' own SDPA
function unchanged.

Measured alternative, not kept: the same folded step as two batched matmuls with float32 scores (``bmm``
with ``out_dtype=float32``, mask, softmax, ``bmm``) took 45.3 ms per decoding step against this SDPA
kernel's 33.4 ms (H200, SmolLM2 shape, batch 512, cap 1,024; docs/benchmarks.md "Regeneration on one
H200", raw ``docs/data/regen_decode_kernels_5331c5c.json``): the float32-output batched matmul
runs on a MAGMA kernel far below the cache's read bandwidth.

The function is registered with transformers' attention interface (``AttentionInterface``, with
``sdpa``'s mask builder) under :data:`NAME`; :func:`decode_attention` switches a model to it for a
block of code. With ``kernel="triton"`` (``regen.decode_kernel``) the folded decoding step runs the
split-K Triton kernel of :mod:`data_prep.decode_attention_kernel` instead of SDPA (registered under
:data:`NAME_TRITON`): it reads only each row's kept cache positions, where SDPA's masked kernels read
the whole static cache.
"""
from __future__ import annotations

import contextlib

import torch

#: the attention implementation names registered with transformers (SDPA and the Triton kernel)
NAME = "peagle_sdpa_gqa_decode"
NAME_TRITON = "peagle_triton_gqa_decode"


def _folds(module, query: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, kwargs) -> bool:
    """Whether the call is a decoding step this module folds: grouped heads, one query, a ``[B, 1, q, L']``
    mask shared by the heads, no dropout, position bias or attention sinks."""
    return not (getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] != 1 or attention_mask is None
                or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or dropout
                or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None)


def gqa_decode_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs):
    """transformers attention function (the signature of ``sdpa_attention_forward``).

    Args:
        query: ``[B, H, q, d]``. key, value: ``[B, Hkv, L, d]``. attention_mask: ``[B, 1, q, L']`` bool
            (True = attend) or additive float, ``L' >= L``, or None.

    Returns:
        ``(attn_output [B, q, H, d], None)``, as transformers' SDPA function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = getattr(module, "num_key_value_groups", 1)
    B, H, q, d = query.shape
    if not _folds(module, query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    hkv, L = key.shape[1], key.shape[2]
    mask = attention_mask[:, :, :, :L].expand(B, 1, g, L)  # the one query row's mask, for each head of a group
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, hkv, g, d), key, value,
                                                           attn_mask=mask, scale=scaling)  # [B, Hkv, g, d]
    return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None


def gqa_decode_triton(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """:func:`gqa_decode_sdpa` with the folded decoding step on the split-K Triton kernel
    (:func:`data_prep.decode_attention_kernel.gqa_decode_attention`) when the mask is boolean; any other
    call (prefill, float masks, ...) goes to :func:`gqa_decode_sdpa`. Same arguments and return value.
    """
    from data_prep.decode_attention_kernel import gqa_decode_attention

    if not _folds(module, query, attention_mask, dropout, kwargs) or attention_mask.dtype != torch.bool:
        return gqa_decode_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               is_causal=is_causal, **kwargs)
    B, H, _, d = query.shape
    hkv, L = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    out = gqa_decode_attention(query.reshape(B, hkv, H // hkv, d), key, value, attention_mask[:, 0, 0, :L], scale)
    return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None


def resolve_kernel(kind: str, device: torch.device | str) -> str:
    """``regen.decode_kernel`` → the kernel that runs: ``"auto"`` is ``"triton"`` where the Triton kernel
    can run (:func:`data_prep.decode_attention_kernel.available`: CUDA with Triton), else ``"sdpa"``.

    Raises:
        RuntimeError: ``"triton"`` where Triton cannot run (say ``regen.decode_kernel: sdpa`` or ``auto``).
        ValueError: an unknown kind.
    """
    from data_prep.decode_attention_kernel import available

    if kind == "auto":
        return "triton" if available(device) else "sdpa"
    if kind == "triton" and not available(device):
        raise RuntimeError(f"regen.decode_kernel: triton needs Triton and a CUDA device (the target is on {device}); "
                           "set regen.decode_kernel: sdpa or auto")
    if kind not in ("sdpa", "triton"):
        raise ValueError(f"unknown regen.decode_kernel {kind!r}; expected auto, sdpa or triton")
    return kind


def register(kernel: str = "sdpa") -> str:
    """Register :func:`gqa_decode_sdpa` (``kernel="sdpa"``, under :data:`NAME`) or :func:`gqa_decode_triton`
    (``"triton"``, under :data:`NAME_TRITON`), with SDPA's mask builder, with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name, fn = (NAME_TRITON, gqa_decode_triton) if kernel == "triton" else (NAME, gqa_decode_sdpa)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def decode_attention(model, kernel: str = "sdpa"):
    """Run the block with ``model`` on :func:`gqa_decode_sdpa` (``kernel="sdpa"``) or :func:`gqa_decode_triton`
    (``"triton"``, see :func:`resolve_kernel`) when it runs transformers' ``sdpa`` with grouped key/value
    heads (otherwise unchanged); its attention implementation is restored after."""
    before = getattr(model.config, "_attn_implementation", None)
    grouped = getattr(model.config, "num_key_value_heads", None) not in (None, getattr(model.config,
                                                                                        "num_attention_heads", None))
    if before != "sdpa" or not grouped:
        yield
        return
    model.set_attn_implementation(register(kernel))
    try:
        yield
    finally:
        model.set_attn_implementation(before)
