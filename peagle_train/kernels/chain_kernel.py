"""Triton kernels for the chain part of the split attention (PEAGLE_SPEC §3).

The chain part gives each grid query ``(anchor a, depth d)`` a softmax over at most ``C = K - 1``
keys: the mask elements ``(a, 1..d)`` of its own anchor, listed in ``index [E_q, C]``
(:func:`~peagle_train.peagle.masks.build_chain_index`). In PyTorch that is a gather of
``[E_q, C, nkv, hd]`` keys and values plus tiny products that Inductor runs as several reduction
kernels with materialised intermediates (about 27 ms of a 306 ms GPT-OSS-20B step on an H200,
``docs/benchmarks.md``). Here it is three kernels that read each gathered row once:

* forward, one program per ``(block of queries, KV head)``: online softmax over the ``C`` slots
  (FlashAttention's recurrence, Dao et al. 2022 §3.1) for the ``g = nh / nkv`` query heads that
  share the KV head; writes ``out`` and the log-sum-exp ``lse`` that
  :func:`~peagle_train.kernels.attention.merge_by_lse` needs;
* backward of the queries: recomputes the probabilities from ``lse``, writes ``dq`` and the
  per-slot score gradients ``ds`` and probabilities ``p`` (``[E_q, nkv, C, g_pad]``, small);
* backward of the keys and values, one program per ``(block of key rows, KV head)``: sums the
  contributions of the ``<= C`` ``(query, slot)`` pairs that read each key through the inverse
  index (:func:`~peagle_train.peagle.masks.invert_chain_index`). No atomics: deterministic.

The gradient of ``lse`` is part of the backward (``merge_by_lse`` uses it):
``ds_c = p_c * (dp_c - Delta + dlse)`` with ``dp_c = dout . v_c`` and ``Delta = dout . out``.

The ops are ``torch.library.triton_op`` s, so a compiled decoder layer (``train.compile``) keeps
them in its graph (no graph break). Triton runs on CUDA; ``TRITON_INTERPRET=1`` runs the same
kernels on CPU tensors (how the tests check them, in float64, against the PyTorch chain part).
"""
from __future__ import annotations

import os

import torch

from peagle_train.core.dtypes import acc_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch ships without Triton
    triton = None
    tl = None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1`` (kernels run on CPU tensors through Triton's interpreter)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: Triton importable and a CUDA device (or the
    interpreter on CPU)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or interpreting()


def resolve(kind: str, device: torch.device) -> str:
    """``train.chain_kernel`` → the implementation that runs: ``"auto"`` is ``"triton"`` where
    :func:`available`, else ``"torch"``.

    Raises:
        RuntimeError: ``kind="triton"`` where Triton cannot run (say ``chain_kernel: torch`` or
            ``auto``, or install Triton / use a CUDA device).
        ValueError: an unknown kind.
    """
    if kind == "auto":
        return "triton" if available(device) else "torch"
    if kind == "triton":
        if not available(device):
            raise RuntimeError(f"train.chain_kernel: triton needs Triton and a CUDA device (device {device}, "
                               f"triton {'installed' if triton is not None else 'not installed'}); "
                               "set chain_kernel: auto or torch")
        return kind
    if kind == "torch":
        return kind
    raise ValueError(f"unknown chain_kernel {kind!r}; expected auto, triton or torch")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


TILING = {"fwd": (4096, 4), "bwd_q": (4096, 4), "bwd_kv": (8192, 4)}
"""Per kernel ``(tile elements, num_warps)``: a program of that kernel works on ``rows`` query (or
key) rows of ``[rows, g, hd]`` tiles, ``rows`` = the power of two at or below ``tile elements /
(g_pad * hd_pad)``, 1 to 64. Read when an op is called eagerly or traced; a compiled graph keeps
the tiling it was traced with. The defaults are the fastest of ``benchmarks/chain_kernel.py``'s
sweep at the GPT-OSS-20B shape (g = 8, hd = 64, N = 8192, K = 8) on an H200
(``docs/data/chain_kernel_s6.json``)."""


def _blocks(g: int, hd: int, kernel: str) -> tuple[int, int, int, int]:
    """``(rows per program, padded g, padded hd, num_warps)`` of ``kernel`` (:data:`TILING`)."""
    elems, warps = TILING[kernel]
    gp, hdp = _pow2(g), _pow2(hd)
    rows = max(1, min(64, elems // (gp * hdp)))
    return 1 << (rows.bit_length() - 1), gp, hdp, warps  # a power of two (tl.arange)


if triton is not None:
    @triton.jit
    def _acc(x, F64: tl.constexpr):
        if F64:
            return x.to(tl.float64)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _query_rows(Eq, G: tl.constexpr, HD: tl.constexpr, BE: tl.constexpr, GP: tl.constexpr,
                    HDP: tl.constexpr):
        """This program's KV head ``n``, query rows ``e [BE]``, head lanes ``j [GP]``, features
        ``d [HDP]``, query heads ``h = n * G + j`` and the masks of real rows / rows x heads /
        rows x heads x features. 64-bit offsets: ``h * stride`` can pass 2**31 on long grids."""
        n = tl.program_id(1).to(tl.int64)
        e = (tl.program_id(0) * BE + tl.arange(0, BE)).to(tl.int64)
        j = tl.arange(0, GP)
        d = tl.arange(0, HDP)
        e_ok = e < Eq
        row_ok = e_ok[:, None] & (j < G)[None, :]
        tile_ok = row_ok[:, :, None] & (d < HD)[None, None, :]
        return n, e, j, d, n * G + j, e_ok, row_ok, tile_ok

    @triton.jit
    def _tile(X, h, e, d, s_h, s_e, s_d, mask, F64: tl.constexpr):
        """``X[h, e, d]`` as a ``[rows, GP, HDP]`` tile in the accumulation dtype (0 where masked)."""
        return _acc(tl.load(X + h[None, :, None] * s_h + e[:, None, None] * s_e + d[None, None, :] * s_d,
                            mask=mask, other=0.0), F64)

    @triton.jit
    def _chain_slot(IDX, OK, K, V, n, e, e_ok, d, c, sk_h, sk_e, sk_d, sv_h, sv_e, sv_d,
                    C: tl.constexpr, HD: tl.constexpr, F64: tl.constexpr):
        """Slot ``c`` of rows ``e``: whether it is read (``ok [BE]``) and its key and value rows of
        KV head ``n`` (``[BE, HDP]``, 0 where not read)."""
        idx = tl.load(IDX + e * C + c, mask=e_ok, other=0)
        ok = (tl.load(OK + e * C + c, mask=e_ok, other=0) != 0) & e_ok
        kv_ok = ok[:, None] & (d < HD)[None, :]
        kc = _acc(tl.load(K + n * sk_h + idx[:, None] * sk_e + d[None, :] * sk_d, mask=kv_ok, other=0.0), F64)
        vc = _acc(tl.load(V + n * sv_h + idx[:, None] * sv_e + d[None, :] * sv_d, mask=kv_ok, other=0.0), F64)
        return ok, kc, vc

    @triton.jit
    def _chain_fwd_kernel(Q, K, V, IDX, OK, OUT, LSE,
                          sq_h, sq_e, sq_d, sk_h, sk_e, sk_d, sv_h, sv_e, sv_d, so_h, so_e, so_d,
                          Eq, scale,
                          G: tl.constexpr, C: tl.constexpr, HD: tl.constexpr,
                          BE: tl.constexpr, GP: tl.constexpr, HDP: tl.constexpr, F64: tl.constexpr):
        n, e, j, d, h, e_ok, row_ok, tile_ok = _query_rows(Eq, G, HD, BE, GP, HDP)
        q = _tile(Q, h, e, d, sq_h, sq_e, sq_d, tile_ok, F64)
        m = _acc(tl.full([BE, GP], float("-inf"), tl.float32), F64)
        l = _acc(tl.zeros([BE, GP], tl.float32), F64)
        acc = _acc(tl.zeros([BE, GP, HDP], tl.float32), F64)
        for c in tl.static_range(C):
            ok, kc, vc = _chain_slot(IDX, OK, K, V, n, e, e_ok, d, c, sk_h, sk_e, sk_d, sv_h, sv_e, sv_d, C, HD, F64)
            s = tl.sum(q * kc[:, None, :], axis=2) * scale
            s = tl.where(ok[:, None], s, float("-inf"))
            m_new = tl.maximum(m, s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)  # 0 while m = -inf
            p = tl.exp(s - m_safe)  # 0 on invalid slots
            l = l * alpha + p
            acc = acc * alpha[:, :, None] + p[:, :, None] * vc[:, None, :]
            m = m_new
        has = l > 0
        l_safe = tl.where(has, l, 1.0)
        out = acc / l_safe[:, :, None]
        lse = tl.where(has, m + tl.log(l_safe), float("-inf"))
        tl.store(OUT + h[None, :, None] * so_h + e[:, None, None] * so_e + d[None, None, :] * so_d,
                 out.to(OUT.dtype.element_ty), mask=tile_ok)
        tl.store(LSE + h[None, :] * Eq + e[:, None], lse.to(LSE.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _chain_bwd_q_kernel(Q, K, V, IDX, OK, OUT, DOUT, LSE, DLSE, DQ, DS, P,
                            sq_h, sq_e, sq_d, sk_h, sk_e, sk_d, sv_h, sv_e, sv_d,
                            so_h, so_e, so_d, sdo_h, sdo_e, sdo_d, sdq_h, sdq_e, sdq_d,
                            Eq, NKV, scale,
                            G: tl.constexpr, C: tl.constexpr, HD: tl.constexpr,
                            BE: tl.constexpr, GP: tl.constexpr, HDP: tl.constexpr, F64: tl.constexpr):
        n, e, j, d, h, e_ok, row_ok, tile_ok = _query_rows(Eq, G, HD, BE, GP, HDP)
        q = _tile(Q, h, e, d, sq_h, sq_e, sq_d, tile_ok, F64)
        o = _tile(OUT, h, e, d, so_h, so_e, so_d, tile_ok, F64)
        do = _tile(DOUT, h, e, d, sdo_h, sdo_e, sdo_d, tile_ok, F64)
        lse = _acc(tl.load(LSE + h[None, :] * Eq + e[:, None], mask=row_ok, other=float("-inf")), F64)
        dlse = _acc(tl.load(DLSE + h[None, :] * Eq + e[:, None], mask=row_ok, other=0.0), F64)
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)  # such a row has only -inf scores: p = 0
        delta = tl.sum(do * o, axis=2)
        dq = _acc(tl.zeros([BE, GP, HDP], tl.float32), F64)
        for c in tl.static_range(C):
            ok, kc, vc = _chain_slot(IDX, OK, K, V, n, e, e_ok, d, c, sk_h, sk_e, sk_d, sv_h, sv_e, sv_d, C, HD, F64)
            s = tl.sum(q * kc[:, None, :], axis=2) * scale
            p = tl.where(ok[:, None], tl.exp(s - lse_safe), 0.0)
            dp = tl.sum(do * vc[:, None, :], axis=2)
            ds = tl.where(ok[:, None], p * (dp - delta + dlse), 0.0)  # 0 on unread slots even for non-finite cotangents
            dq += ds[:, :, None] * kc[:, None, :]
            slot = ((e[:, None] * NKV + n) * C + c) * GP + j[None, :]
            tl.store(DS + slot, ds.to(DS.dtype.element_ty), mask=row_ok)
            tl.store(P + slot, p.to(P.dtype.element_ty), mask=row_ok)
        tl.store(DQ + h[None, :, None] * sdq_h + e[:, None, None] * sdq_e + d[None, None, :] * sdq_d,
                 (dq * scale).to(DQ.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def _chain_bwd_kv_kernel(Q, DOUT, INV, INV_OK, DS, P, DK, DV,
                             sq_h, sq_e, sq_d, sdo_h, sdo_e, sdo_d, sdk_h, sdk_e, sdk_d, sdv_h, sdv_e, sdv_d,
                             Ek, NKV, scale,
                             G: tl.constexpr, C: tl.constexpr, HD: tl.constexpr,
                             BK: tl.constexpr, GP: tl.constexpr, HDP: tl.constexpr, F64: tl.constexpr):
        n, r, j, d, h, r_ok, _, _ = _query_rows(Ek, G, HD, BK, GP, HDP)  # here the rows are key rows
        dk = _acc(tl.zeros([BK, HDP], tl.float32), F64)
        dv = _acc(tl.zeros([BK, HDP], tl.float32), F64)
        for t in tl.static_range(C):
            inv = tl.load(INV + r * C + t, mask=r_ok, other=0)
            ok = (tl.load(INV_OK + r * C + t, mask=r_ok, other=0) != 0) & r_ok
            e = inv // C  # the query row and slot that read this key in its t-th reader
            c = inv % C
            row_ok = ok[:, None] & (j < G)[None, :]
            tile_ok = row_ok[:, :, None] & (d < HD)[None, None, :]
            slot = ((e[:, None] * NKV + n) * C + c[:, None]) * GP + j[None, :]
            ds = _acc(tl.load(DS + slot, mask=row_ok, other=0.0), F64)
            p = _acc(tl.load(P + slot, mask=row_ok, other=0.0), F64)
            q = _tile(Q, h, e, d, sq_h, sq_e, sq_d, tile_ok, F64)
            do = _tile(DOUT, h, e, d, sdo_h, sdo_e, sdo_d, tile_ok, F64)
            dk += tl.sum(ds[:, :, None] * q, axis=1)
            dv += tl.sum(p[:, :, None] * do, axis=1)
        out_ok = r_ok[:, None] & (d < HD)[None, :]
        tl.store(DK + n * sdk_h + r[:, None] * sdk_e + d[None, :] * sdk_d, (dk * scale).to(DK.dtype.element_ty),
                 mask=out_ok)
        tl.store(DV + n * sdv_h + r[:, None] * sdv_e + d[None, :] * sdv_d, dv.to(DV.dtype.element_ty), mask=out_ok)

    from torch.library import triton_op, wrap_triton


    def _strides(*ts: torch.Tensor) -> list:
        """(head, row, feature) strides of each ``[1, heads, rows, hd]`` tensor, in order."""
        return [x for t in ts for x in t.stride()[1:]]

    def _launch(kernel):
        """``wrap_triton(kernel)`` (so torch.compile traces the launch), or the kernel itself under the
        interpreter (``wrap_triton`` accepts only compiled kernels)."""
        return kernel if interpreting() else wrap_triton(kernel)

    @triton_op("peagle::chain_attention_fwd", mutates_args={})
    def chain_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                            valid: torch.Tensor, inverse: torch.Tensor, inverse_valid: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain-part forward (module docstring); ``inverse``/``inverse_valid`` are carried for the
        backward. Returns ``(out [1, nh, E_q, hd]`` in ``q.dtype``, ``lse [1, nh, E_q]`` float32
        (float64 for float64)``)``."""
        _, nh, Eq, hd = q.shape
        nkv = k.shape[1]
        C = index.shape[1]
        be, gp, hdp, warps = _blocks(nh // nkv, hd, "fwd")
        out = torch.empty_like(q)
        lse = torch.empty((1, nh, Eq), dtype=acc_dtype(q.dtype), device=q.device)
        if Eq:  # an empty grid launches nothing
            _launch(_chain_fwd_kernel)[(triton.cdiv(Eq, be), nkv)](
                q, k, v, index, valid, out, lse,
                *_strides(q, k, v, out), Eq, scale, G=nh // nkv, C=C, HD=hd, BE=be, GP=gp, HDP=hdp, F64=q.dtype == torch.float64,
                num_warps=warps)
        return out, lse

    @triton_op("peagle::chain_attention_bwd_q", mutates_args={})
    def chain_attention_bwd_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                              valid: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                              dlse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query gradient ``dq`` (like ``q``) and the per-slot ``ds``, ``p`` ``[E_q, nkv, C, g_pad]``
        (float32; float64 for float64) that :func:`chain_attention_bwd_kv` sums per key."""
        _, nh, Eq, hd = q.shape
        nkv = k.shape[1]
        C = index.shape[1]
        be, gp, hdp, warps = _blocks(nh // nkv, hd, "bwd_q")
        dq = torch.empty_like(q)
        ds = torch.empty((Eq, nkv, C, gp), dtype=acc_dtype(q.dtype), device=q.device)
        p = torch.empty_like(ds)
        if Eq:  # an empty grid launches nothing
            _launch(_chain_bwd_q_kernel)[(triton.cdiv(Eq, be), nkv)](
                q, k, v, index, valid, out, dout, lse, dlse, dq, ds, p,
                *_strides(q, k, v, out, dout, dq), Eq, nkv, scale, G=nh // nkv, C=C, HD=hd, BE=be, GP=gp, HDP=hdp, F64=q.dtype == torch.float64,
                num_warps=warps)
        return dq, ds, p

    @triton_op("peagle::chain_attention_bwd_kv", mutates_args={})
    def chain_attention_bwd_kv(q: torch.Tensor, dout: torch.Tensor, k: torch.Tensor, inverse: torch.Tensor,
                               inverse_valid: torch.Tensor, ds: torch.Tensor, p: torch.Tensor,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value gradients ``(dk, dv)`` like ``k`` ``[1, nkv, E_kv, hd]``: per key row the sum
        over the ``(query, slot)`` pairs of ``inverse [E_kv, C]`` (0 for rows no chain reads)."""
        _, nh, _, hd = q.shape
        nkv, Ek = k.shape[1], k.shape[2]
        C = inverse.shape[1]
        be, gp, hdp, warps = _blocks(nh // nkv, hd, "bwd_kv")
        dk = torch.empty_like(k)
        dv = torch.empty_like(k)  # k and v share shape and dtype (chain_attention_triton checks)
        if Ek:  # an empty grid launches nothing
            _launch(_chain_bwd_kv_kernel)[(triton.cdiv(Ek, be), nkv)](
                q, dout, inverse, inverse_valid, ds, p, dk, dv,
                *_strides(q, dout, dk, dv), Ek, nkv, scale, G=nh // nkv, C=C, HD=hd, BK=be, GP=gp, HDP=hdp, F64=q.dtype == torch.float64,
                num_warps=warps)
        return dk, dv

    def _setup_context(ctx, inputs, output):
        q, k, v, index, valid, inverse, inverse_valid, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, index, valid, inverse, inverse_valid, out, lse)
        ctx.scale = scale

    def _backward(ctx, dout, dlse):
        q, k, v, index, valid, inverse, inverse_valid, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = torch.zeros_like(lse) if dlse is None else dlse.contiguous()  # the kernel reads [1, nh, E_q] rows
        dq, ds, p = chain_attention_bwd_q(q, k, v, index, valid, out, dout, lse, dlse, ctx.scale)
        dk, dv = chain_attention_bwd_kv(q, dout, k, inverse, inverse_valid, ds, p, ctx.scale)
        return dq, dk, dv, None, None, None, None, None

    chain_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def chain_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                           valid: torch.Tensor, inverse: torch.Tensor, inverse_valid: torch.Tensor,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain part (same contract as :func:`~peagle_train.kernels.attention.chain_attention`) on the
    Triton kernels of this module, differentiable in ``q``, ``k`` and ``v``.

    Args:
        q: ``[1, nh, E_q, hd]``; k, v: ``[1, nkv, E_kv, hd]``, same shape and dtype as each other
            (any strides; ``nh % nkv == 0``).
        index, valid: ``[E_q, C]`` int64 / bool chain index; inverse, inverse_valid: ``[E_kv, C]``
            (:func:`~peagle_train.peagle.masks.invert_chain_index`), used by the key/value backward.
            Made contiguous here (the kernels read them row-major).
        scale: score scale, default ``1 / sqrt(hd)``. Triton passes it as float32: in float64 on
            CUDA the result is exact to float64 only where the scale is (``hd`` a power of 4, e.g.
            64); the interpreter keeps it in float64.

    Returns:
        ``(out [1, nh, E_q, hd]`` in ``q.dtype``, ``lse [1, nh, E_q]`` float32 (float64 for float64),
        ``-inf`` and ``out = 0`` on rows without a valid slot``)``.

    Raises:
        RuntimeError: Triton is not installed or cannot run on this device (:func:`available`).
        ValueError: a batch other than 1, k and v of different shapes or dtypes, a head dim that
            differs between q and k, ``nh`` not a multiple of ``nkv``, or index shapes that do not
            match (``inverse_valid`` missing included).
    """
    B, nh, Eq, hd = q.shape
    nkv, Ek = k.shape[1], k.shape[2]
    if B != 1 or k.shape[0] != 1:
        raise ValueError(f"chain_attention_triton: batch must be 1 (the grid is one flat sequence); got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape != v.shape or k.dtype != v.dtype or k.shape[3] != hd:
        raise ValueError(f"chain_attention_triton: k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} "
                         f"must match each other and q's head dim {hd}")
    if inverse is None or inverse_valid is None:
        raise ValueError("chain_attention_triton: needs inverse and inverse_valid (invert_chain_index)")
    if nh % nkv:
        raise ValueError(f"chain_attention_triton: {nh} query heads are not a multiple of {nkv} KV heads")
    if index.shape != valid.shape or index.shape[0] != Eq:
        raise ValueError(f"chain_attention_triton: index {tuple(index.shape)} / valid {tuple(valid.shape)} "
                         f"must both be [E_q={Eq}, C]")
    if inverse.shape != (Ek, index.shape[1]) or inverse_valid.shape != inverse.shape:
        raise ValueError(f"chain_attention_triton: inverse {tuple(inverse.shape)} must be [E_kv={Ek}, "
                         f"C={index.shape[1]}] like inverse_valid {tuple(inverse_valid.shape)}")
    if not available(q.device):
        raise RuntimeError(f"chain_attention_triton: Triton cannot run on {q.device} "
                           f"({'no triton' if triton is None else 'set TRITON_INTERPRET=1 for CPU'})")
    scale = hd ** -0.5 if scale is None else float(scale)
    index, valid, inverse, inverse_valid = (t.contiguous() for t in (index, valid, inverse, inverse_valid))
    return torch.ops.peagle.chain_attention_fwd(q, k, v, index, valid, inverse, inverse_valid, scale)
