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

Two kernels compute the folded step: PyTorch's masked SDPA (:func:`gqa_decode_sdpa`, whose CUDA
backends tile 64-128 query rows per block although a step has only ``H/Hkv``) and two batched matmuls
(:func:`gqa_decode_bmm`): scores ``[B*Hkv, g, L]`` in float32 (bf16 inputs, float32 accumulation and
output), the mask and a float32 softmax, the probabilities cast to the value dtype for the second matmul,
as flash kernels do. With ``g`` rows per KV head the score tensor is ``4g / (4d)`` of the K/V bytes, so
the step reads the cache about once.

The functions are registered with transformers' attention interface (``AttentionInterface``, with
``sdpa``'s mask builder) under :data:`NAME` and :data:`NAME_BMM`; :func:`decode_attention` switches a
model to one of them for a block of code.
"""
from __future__ import annotations

import contextlib

import torch

#: the attention implementation names registered with transformers (kernel "sdpa" and "bmm")
NAME = "peagle_sdpa_gqa_decode"
NAME_BMM = "peagle_bmm_gqa_decode"


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
    if not _foldable(g, q, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    hkv, L = key.shape[1], key.shape[2]
    mask = attention_mask[:, :, :, :L].expand(B, 1, g, L)  # the one query row's mask, for each head of a group
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, hkv, g, d), key, value,
                                                           attn_mask=mask, scale=scaling)  # [B, Hkv, g, d]
    return out.reshape(B, H, 1, d).transpose(1, 2).contiguous(), None


def _foldable(g: int, q: int, attention_mask, dropout: float, kwargs: dict) -> bool:
    """True for a grouped decoding step with one per-key mask row and nothing else the folded kernels skip."""
    return not (g == 1 or q != 1 or attention_mask is None or attention_mask.dim() != 4
                or attention_mask.shape[1] != 1 or dropout or kwargs.get("position_bias") is not None
                or kwargs.get("s_aux") is not None)


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 3-D tensors with at least float32 output: on CUDA bf16/fp16 inputs stay as they are
    (float32 accumulation, ``torch.bmm(..., out_dtype=float32)``); elsewhere half-precision inputs are
    upcast; float32 and float64 are multiplied as they are."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def gqa_decode_bmm(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """:func:`gqa_decode_sdpa` computed with two batched matmuls instead of an SDPA kernel (same
    arguments and result). Scores and softmax are float32; the probabilities are cast to ``value``'s
    dtype for ``P @ V`` (float32 accumulation). Steps the fold does not cover go to transformers' SDPA.

    Args:
        query: ``[B, H, 1, d]``. key, value: ``[B, Hkv, L, d]``. attention_mask: ``[B, 1, 1, L']``
            bool (True = attend) or additive float, ``L' >= L``.

    Returns:
        ``(attn_output [B, 1, H, d] in query's dtype, None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = getattr(module, "num_key_value_groups", 1)
    B, H, q, d = query.shape
    if not _foldable(g, q, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    hkv, L = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    s = _bmm_f32(query.reshape(B * hkv, g, d), key.reshape(B * hkv, L, d).transpose(1, 2)).view(B, hkv, g, L)
    mask = attention_mask[:, :, :, :L]  # [B, 1, 1, L]: the same row for every head of every group
    s = s * scale
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1).to(value.dtype).view(B * hkv, g, L)
    out = torch.bmm(p, value.reshape(B * hkv, L, d))  # [B*Hkv, g, d]
    return out.view(B, H, 1, d).transpose(1, 2).contiguous(), None


def register(kernel: str = "sdpa") -> str:
    """Register the folded decoding attention of ``kernel`` (``"sdpa"``: :func:`gqa_decode_sdpa`,
    ``"bmm"``: :func:`gqa_decode_bmm`) with SDPA's mask builder; returns its name (:data:`NAME`,
    :data:`NAME_BMM`).

    Raises:
        ValueError: an unknown kernel.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    fns = {"sdpa": (NAME, gqa_decode_sdpa), "bmm": (NAME_BMM, gqa_decode_bmm)}
    if kernel not in fns:
        raise ValueError(f"decode kernel {kernel!r}: expected one of {sorted(fns)} (regen.decode_kernel)")
    name, fn = fns[kernel]
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def decode_attention(model, kernel: str = "sdpa"):
    """Run the block with ``model`` on the folded decoding attention of ``kernel`` (:func:`register`)
    when it runs transformers' ``sdpa`` with grouped key/value heads (otherwise unchanged); its
    attention implementation is restored after."""
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
