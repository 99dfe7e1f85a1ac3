"""A split-K decoding attention kernel (Triton) for regeneration over a static KV cache (engine
``static``, ``regen.decode_kernel``).

Why: a decoding step over a left-padded static cache always carries a mask, and PyTorch's masked SDPA
kernels (cuDNN / efficient attention) are prefill kernels: they tile 64+ query rows where a decoding
step has ``H / Hkv`` (3 for SmolLM2) and read every cache position, filled or not. On an H200 at batch
512 the folded SDPA step (:mod:`data_prep.gqa_decode_attention`) took 12.4 ms of a 32.3 ms decoding
step at cap 256 and the same SDPA without a mask read the cache 2.4–4.7× faster (docs/benchmarks.md,
"Decoding attention kernels for regeneration", ``docs/data/decode_attention_4fe764a.json``).

What: flash-decoding (split-K over the keys; Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", 2023), with the online softmax of FlashAttention (Dao et al., 2022). Program ``(b, h, s)`` takes the ``g = H / Hkv`` query heads that share
key/value head ``h`` of row ``b`` and the keys of chunk ``s`` (``chunk`` positions) intersected with
the row's kept range ``[start_b, end_b)`` (first and last True of the row's mask), so positions before
the left padding ends and after the last written cache slot are never read. Inside the range the mask
is applied position by position, so any boolean mask gives the exact masked softmax, not only
left-padding ones. Each program writes an unnormalised partial output, its running max and its sum
(base-2 online softmax, float32 -- float64 for float64 inputs); :func:`combine_partials` merges the
chunks: ``out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s`` with ``M = max_s m_s``. A row with no
kept key gets 0 (SDPA gives NaN there; generation never has such a row).

The op is a ``torch.library.triton_op``, so the decoding step transformers compiles (CUDA graphs)
keeps it in its graph. ``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors: how the tests
check it in float64 against SDPA (``tests/unit/interp_decode_kernel.py``). This module must not
import ``peagle_train`` (data_prep stands alone).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch ships without Triton
    triton = None
    tl = None

#: key positions per split (program); a multiple of :data:`BLOCK_N`
CHUNK = 256
#: key positions per inner tile
BLOCK_N = 64


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (the kernel runs on CPU tensors through Triton's interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run on ``device``: Triton importable and a CUDA device (or the interpreter)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or interpreting()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def kept_range(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last kept key of each row.

    Args:
        keep: ``[B, L]`` bool, True = the query attends to that key.

    Returns:
        ``(start, end)``, each ``[B]`` int32: ``keep[b, :start[b]]`` and ``keep[b, end[b]:]`` are all
        False. A row with no kept key gets ``(0, 0)``.

    Example: ``keep = [[F, F, T, T, F]]`` gives ``start = [2]``, ``end = [4]``.
    """
    L = keep.shape[-1]
    k = keep.to(torch.int32)
    any_kept = k.amax(dim=-1) > 0
    start = torch.where(any_kept, k.argmax(dim=-1), 0)
    end = torch.where(any_kept, L - k.flip(-1).argmax(dim=-1), 0)
    return start.to(torch.int32), end.to(torch.int32)


def combine_partials(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Merge the split-K partials of the online softmax.

    Args:
        o: ``[P, S, G, D]`` unnormalised partial outputs (float32 or float64), ``S`` splits.
        m: ``[P, S, G]`` running max of each split's scores in log2 units (``-inf``: no kept key).
        l: ``[P, S, G]`` each split's ``sum 2^(score - m)``.

    Returns:
        ``[P, G, D]`` in ``o``'s dtype: ``sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s``, ``M = max_s
        m_s``; 0 where no split kept a key.
    """
    M = m.amax(dim=1, keepdim=True)
    w = torch.where(m == float("-inf"), 0.0, torch.exp2(m - torch.where(M == float("-inf"), 0.0, M)))  # [P, S, G]
    num = (o * w.unsqueeze(-1)).sum(dim=1)
    den = (l * w).sum(dim=1).unsqueeze(-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


if triton is not None:
    @triton.jit
    def _decode_split_kernel(Q, K, V, KEEP, START, END, PO, PM, PL,
                             sq_b, sq_h, sq_g, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                             skeep_b, skeep_l, Hkv, G, D, chunk, scale_log2,
                             BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
                             F64: tl.constexpr, IEEE: tl.constexpr):
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // Hkv
        h = bh % Hkv
        acc_t = tl.float64 if F64 else tl.float32
        gs = tl.arange(0, BG)
        ds = tl.arange(0, BD)
        g_ok = gs < G
        d_ok = ds < D
        q = tl.load(Q + b * sq_b + h * sq_h + gs[:, None] * sq_g + ds[None, :] * sq_d,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        lo = tl.maximum(s * chunk, tl.load(START + b))
        hi = tl.minimum(s * chunk + chunk, tl.load(END + b))
        m_i = tl.full([BG], float("-inf"), acc_t)
        l_i = tl.zeros([BG], acc_t)
        acc = tl.zeros([BG, BD], acc_t)
        for n0 in range(lo, hi, BN):
            ns = n0 + tl.arange(0, BN)
            keep = tl.load(KEEP + b * skeep_b + ns * skeep_l, mask=ns < hi, other=0) != 0
            kv_ok = keep[:, None] & d_ok[None, :]
            k = tl.load(K + b * sk_b + h * sk_h + ns[:, None] * sk_l + ds[None, :] * sk_d, mask=kv_ok, other=0.0)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_t)
            else:
                sc = tl.dot(q, tl.trans(k), out_dtype=acc_t)
            sc = tl.where(keep[None, :], (sc * scale_log2).to(acc_t), float("-inf"))  # inductor passes a float64 scale
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * sv_b + h * sv_h + ns[:, None] * sv_l + ds[None, :] * sv_d, mask=kv_ok, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=acc_t)
            else:
                pv = tl.dot(p.to(v.dtype), v, out_dtype=acc_t)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        row = bh * NS + s  # partials are [B*Hkv, NS, BG, (BD)] contiguous
        tl.store(PO + (row * BG + gs[:, None]) * BD + ds[None, :], acc)
        tl.store(PM + row * BG + gs, m_i)
        tl.store(PL + row * BG + gs, l_i)

    from torch.library import triton_op, wrap_triton

    def _launch(kernel):
        """``wrap_triton(kernel)`` (torch.compile traces the launch), or the kernel itself under the interpreter."""
        return kernel if interpreting() else wrap_triton(kernel)

    @triton_op("peagle::gqa_decode_attention", mutates_args={})
    def _gqa_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, start: torch.Tensor,
                       end: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
        B, Hkv, G, D = q.shape
        L = k.shape[2]
        ns = max(1, triton.cdiv(L, chunk))
        bg, bd = max(16, _pow2(G)), max(16, _pow2(D))
        f64 = q.dtype == torch.float64
        acc = torch.float64 if f64 else torch.float32
        po = torch.empty((B * Hkv, ns, bg, bd), dtype=acc, device=q.device)
        pm = torch.empty((B * Hkv, ns, bg), dtype=acc, device=q.device)
        pl = torch.empty((B * Hkv, ns, bg), dtype=acc, device=q.device)
        _launch(_decode_split_kernel)[(B * Hkv, ns)](
            q, k, v, keep, start, end, po, pm, pl, *q.stride(), *k.stride(), *v.stride(), *keep.stride(),
            Hkv, G, D, chunk, scale * 1.4426950408889634,
            BG=bg, BD=bd, BN=BLOCK_N, NS=ns, F64=f64, IEEE=q.dtype != torch.bfloat16 and q.dtype != torch.float16,
            num_warps=4)
        out = combine_partials(po, pm, pl)[:, :G, :D]  # [B*Hkv, G, D]
        return out.reshape(B, Hkv, G, D).to(q.dtype)


def gqa_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                         scale: float, chunk: int = CHUNK) -> torch.Tensor:
    """One decoding step's attention of grouped query heads over a KV cache (module docstring).

    Args:
        q: ``[B, Hkv, G, D]``: the ``G`` query heads of each key/value head (query head ``h * G + j``
            is ``q[:, h, j]``), one query position. float32, float64, bfloat16 or float16.
        k, v: ``[B, Hkv, L, D]``, ``q``'s dtype and device; any strides.
        keep: ``[B, L]`` bool, True = attend (the row's mask over the cache positions).
        scale: softmax scale (``1 / sqrt(D)`` in most models).
        chunk: key positions per split, a multiple of :data:`BLOCK_N`.

    Returns:
        ``[B, Hkv, G, D]`` in ``q.dtype``: ``softmax(scale * q k^T masked) v`` per row and head; 0 for a
        row with no kept key.

    Raises:
        RuntimeError: Triton cannot run on ``q``'s device (:func:`available`).
        ValueError: shapes or dtypes that do not match, or ``chunk`` not a positive multiple of
            :data:`BLOCK_N`.
    """
    if not available(q.device):
        raise RuntimeError(f"the Triton decoding kernel needs Triton and a CUDA device (device {q.device}, "
                           f"triton {'installed' if triton is not None else 'not installed'}); "
                           "set regen.decode_kernel: sdpa")
    B, Hkv, G, D = q.shape
    if k.shape[:2] != (B, Hkv) or k.shape[3] != D or v.shape != k.shape or keep.shape != (B, k.shape[2]):
        raise ValueError(f"gqa_decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"keep {tuple(keep.shape)}: expected q [B, Hkv, G, D], k and v [B, Hkv, L, D], keep [B, L]")
    if k.dtype != q.dtype or v.dtype != q.dtype or keep.dtype != torch.bool:
        raise ValueError(f"gqa_decode_attention: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}, keep {keep.dtype}: "
                         "k and v must have q's dtype and keep must be bool")
    if chunk <= 0 or chunk % BLOCK_N:
        raise ValueError(f"gqa_decode_attention: chunk {chunk} must be a positive multiple of {BLOCK_N}")
    start, end = kept_range(keep)  # (a bool tensor's uint8 view does not lower in inductor: an int8 copy, B*L bytes)
    return _gqa_decode_op(q, k, v, keep.to(torch.int8), start, end, float(scale), int(chunk))
