"""Attention compute for the drafter: the split form (FlexAttention prefix + gathered chain,
merged by log-sum-exp), one joint FlexAttention kernel, or dense SDPA (spec §3).

The masks these kernels read are built by :mod:`peagle_train.peagle.masks` (pure);
:func:`make_attn_spec` turns grid metadata into the :class:`AttnSpec` the drafter's layers take.
Shape legend: ``E`` grid elements, ``nh``/``nkv`` query/KV heads, ``hd`` head dim, ``C`` chain slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from peagle_train.core.dtypes import acc_dtype
from peagle_train.kernels.chain_kernel import chain_attention_triton, resolve
from peagle_train.peagle.masks import (
    GridMeta,
    SplitMasks,
    build_block_mask,
    build_chain_index,
    dense_mask,
    invert_chain_index,
)


class _ChainGather(torch.autograd.Function):
    """``rows[index]`` whose backward gathers through the inverse index (deterministic, no atomics)."""

    @staticmethod
    def forward(ctx, rows, index, inverse, inverse_valid):
        ctx.save_for_backward(inverse, inverse_valid)
        return rows[index]

    @staticmethod
    def backward(ctx, grad):
        inverse, inverse_valid = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])[inverse]  # [E_kv, C, D]
        g = torch.where(inverse_valid[..., None], g, torch.zeros((), dtype=g.dtype, device=g.device))
        return g.sum(1), None, None, None


def chain_gather(rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None = None,
                 inverse_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [E_kv, D]`` gathered at ``index [E_q, C]`` → ``[E_q, C, D]``.

    With the inverse of a chain index (:func:`invert_chain_index`) the gradient of ``rows`` is a
    gather-and-sum over each key's readers, counting only valid slots: exact for the chain part,
    whose invalid slots carry zero gradient (their scores are masked to ``-inf`` before the softmax).
    Without it: plain indexing (autograd's ``index_add`` backward).
    """
    if inverse is None:
        return rows[index]
    return _ChainGather.apply(rows, index, inverse, inverse_valid)


#: ``train.prefix_kernel_options: auto`` on CUDA compute capability 9 (H100, H200) for head dimension 64 in bf16 / fp16
#: (:data:`AUTO_BLOCK_SCOPE`): FlexAttention's forward block of the prefix part. Measured on one H100 in the trainer's
#: own step (GPT-OSS-20B drafter shape: head dimension 64, bf16): N = 131,072 40.86 s a step against 48.95 s without
#: (-16.5 %), N = 16,384 742.3 against 773.3 ms (-4.0 %); N = 8,192 298.3 / 290.2 ms (default compile /
#: max-autotune) against 302.3 / 290.3 ms without on another H100 (docs/benchmarks.md, section 'Kernel options
#: inside the N = 131,072 step, and where its time goes (H100, 47e0feb, 2026-12-07)').
HOPPER_PREFIX_KERNEL_OPTIONS = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3}


#: ``(head dimension, dtypes)`` where ``auto``'s block was measured; elsewhere (e.g. head dimension 128, or float32
#: with its larger tiles in shared memory) ``auto`` leaves FlexAttention its own choice (:func:`auto_block_fits`).
AUTO_BLOCK_SCOPE = (64, (torch.bfloat16, torch.float16))


def auto_block_fits(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``train.prefix_kernel_options: auto``'s block (:data:`HOPPER_PREFIX_KERNEL_OPTIONS`) applies to a prefix
    attention of head dimension ``head_dim`` in ``dtype``: only where it was measured (:data:`AUTO_BLOCK_SCOPE`).
    Static attributes only (a shape and a dtype), so a compiled layer decides it while tracing."""
    return head_dim == AUTO_BLOCK_SCOPE[0] and dtype in AUTO_BLOCK_SCOPE[1]


def prefix_options_to_run(options, auto: bool, head_dim: int, dtype: torch.dtype):
    """The prefix part's FlexAttention ``kernel_options`` that run for a layer of head dimension ``head_dim`` in
    ``dtype``: ``options`` (resolved for the device: sorted pairs or a mapping, or None) as they are, except that
    options from ``auto`` (``auto`` True) run only where :func:`auto_block_fits` (else None, FlexAttention's own
    choice). Static attributes only, so a compiled layer decides it while tracing. Raises nothing."""
    if not options or (auto and not auto_block_fits(head_dim, dtype)):
        return None
    return options


def prefix_kernel_options_for(value: str | dict | None, capability: tuple[int, int] | None) -> dict | None:
    """``train.prefix_kernel_options`` → the FlexAttention ``kernel_options`` the prefix part runs with.

    Args:
        value: ``"auto"``, a mapping of tuning options (validated by the recipe), or ``None`` (FlexAttention's
            own choice; ``{}`` counts as ``None``).
        capability: CUDA compute capability ``(major, minor)`` of the device the prefix part runs on; ``None``
            for a device without one (CPU).

    Returns:
        ``"auto"``: a copy of :data:`HOPPER_PREFIX_KERNEL_OPTIONS` for major 9 (H100, H200), else ``None``
        (other GPUs were not measured; CPU's eager FlexAttention ignores options); :func:`split_attention` then
        applies them only to a head dimension and dtype that :func:`auto_block_fits`. A mapping: itself (a dict;
        ``None`` where empty). ``None``: ``None``.

    The forward block of :data:`HOPPER_PREFIX_KERNEL_OPTIONS`, measured on one H100 in the trainer's own step
    (GPT-OSS-20B drafter shape, head dimension 64, bf16): N = 131,072 40.86 s a step against 48.95 s (-16.5 %),
    N = 16,384 742.3 against 773.3 ms (-4.0 %); N = 8,192 298.3 / 290.2 ms (default compile / max-autotune)
    against 302.3 / 290.3 ms without it on another H100. Adding the backward block as it ran
    (``BLOCK_M1: 32, BLOCK_N1: 128, BLOCK_M2: 128, BLOCK_N2: 32, num_warps: 4, num_stages: 3``; the ``fwd_`` names
    keep the forward's) gave 38.12 s at N = 131,072 but +5 % at N = 8,192, so it is a per-recipe choice, not part
    of ``"auto"`` (docs/benchmarks.md, section 'Kernel options inside the N = 131,072 step, and where its time goes
    (H100, 47e0feb, 2026-12-07)').

    Raises:
        ValueError: ``value`` is a string other than ``"auto"``.
        TypeError: ``value`` is neither a string, a mapping nor ``None``.
    """
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"train.prefix_kernel_options: {value!r} is not allowed; expected 'auto', a mapping "
                             "of FlexAttention tuning options, or None")
        return dict(HOPPER_PREFIX_KERNEL_OPTIONS) if capability is not None and capability[0] == 9 else None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"train.prefix_kernel_options: expected 'auto', a mapping or None, got {value!r}")
    return dict(value) or None


@cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability ``(major, minor)`` of ``device`` (cached per device index), ``None`` for a
    device that is not CUDA (CPU)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def build_split_masks(q: GridMeta, kv: GridMeta | None = None, block_size: int = 128,
                      min_chain: int = 0, max_depth: int | None = None, chain_kernel: str = "torch",
                      prefix_kernel_options: str | dict | None = None,
                      prefix_compiled_apart: bool = False) -> SplitMasks:
    """Prefix ``BlockMask`` + chain index (and its inverse) of the split form (no ``E_q × E_kv``
    tensor; see :func:`build_block_mask`, :func:`build_chain_index` and :func:`invert_chain_index`
    for the arguments and errors). With ``max_depth`` no step of it waits for the device.
    ``chain_kernel``: ``"auto"``, ``"triton"`` or ``"torch"``, resolved for the grid's device
    (:func:`peagle_train.kernels.chain_kernel.resolve`, which raises where Triton cannot run).
    ``prefix_kernel_options``: FlexAttention ``kernel_options`` of the prefix part (``train.prefix_kernel_options``:
    ``"auto"``, a mapping or None), resolved for the grid's device (:func:`prefix_kernel_options_for` with
    :func:`device_capability`) and kept on the result as sorted pairs; None where that gives none (FlexAttention's
    own choice); from ``"auto"`` they are marked so (``prefix_kernel_options_auto``) and :func:`split_attention`
    applies them only where :func:`auto_block_fits` the layer's head dimension and dtype. ``prefix_compiled_apart``
    (``train.prefix_compiled_apart``): kept on the result, see :func:`split_attention`. Raises ValueError for a
    string other than ``"auto"``, TypeError for a value neither a string, a mapping nor None."""

    kv = q if kv is None else kv
    kernel = resolve(chain_kernel, q.anchor.device)
    resolved = prefix_kernel_options_for(prefix_kernel_options, device_capability(q.anchor.device))
    index, valid = build_chain_index(q, kv, min_chain, max_depth=max_depth)
    inverse, inverse_valid = invert_chain_index(index, valid, len(kv), sync_check=max_depth is None)
    options = tuple(sorted(resolved.items())) if resolved else None
    return SplitMasks(build_block_mask(q, kv, block_size, part="prefix"), index, valid, inverse, inverse_valid,
                      kernel, options,
                      prefix_kernel_options_auto=options is not None and prefix_kernel_options == "auto",
                      prefix_compiled_apart=bool(prefix_compiled_apart))


def _masked_softmax_lse(s: torch.Tensor, ok: torch.Tensor):
    """Softmax over the last dim of scores ``s`` where ``ok`` (broadcast), and its log-sum-exp.

    Masked before the exponential (no ``inf * 0`` in the backward); a row without any ``ok`` entry
    gives probabilities 0, ``lse = -inf`` and zero, finite gradients.

    Returns:
        ``(p`` like ``s``, ``lse`` like ``s`` with the last dim kept as 1``)``.
    """
    s = torch.where(ok, s, torch.full_like(s, float("-inf")))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows without a key: any finite shift
    e = torch.exp(s - m)  # exactly 0 where masked
    has = ok.any(-1, keepdim=True)
    total = torch.where(has, e.sum(-1, keepdim=True), torch.ones_like(m))
    return e / total, torch.where(has, torch.log(total) + m, torch.full_like(m, float("-inf")))


def chain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                    valid: torch.Tensor, scale: float | None = None, inverse: torch.Tensor | None = None,
                    inverse_valid: torch.Tensor | None = None, kernel: str = "torch"):
    """Softmax attention of each query over its own chain keys only (the chain part).

    GQA without repeating k/v: query head ``h`` reads KV head ``h // (nh // nkv)``, as
    FlexAttention/SDPA with ``enable_gqa``. The gathered keys are ``[E_q, C, nkv, hd]``.

    Args:
        q: ``[1, nh, E_q, hd]``. k, v: ``[1, nkv, E_kv, hd]``.
        index: ``[E_q, C]`` int64 rows of k/v. valid: ``[E_q, C]`` bool.
        inverse, inverse_valid: :func:`invert_chain_index` of ``index``: the k/v gradient is then a
            deterministic gather (:func:`chain_gather`); None = autograd's ``index_add``.
        scale: score scale; default ``1 / sqrt(hd)`` (FlexAttention's and SDPA's).
        kernel: ``"torch"`` (below) or ``"triton"``: the fused kernels of
            :func:`peagle_train.kernels.chain_kernel.chain_attention_triton` (needs ``inverse`` and
            ``inverse_valid``; CUDA, or
            ``TRITON_INTERPRET=1`` on CPU), same contract.

    Returns:
        ``(out [1, nh, E_q, hd]`` in ``q.dtype``, ``lse [1, nh, E_q]`` natural-log log-sum-exp of
        the scaled scores over the valid slots, ``-inf`` where there is none, in float32 for half
        inputs (float64 stays float64)``)``. Rows without a valid slot give ``out = 0``, and
        finite (zero) gradients.

    Raises:
        ValueError: ``kernel="triton"`` without ``inverse``/``inverse_valid``, or an unknown ``kernel``.
    """
    if kernel == "triton":
        if inverse is None or inverse_valid is None:
            raise ValueError("chain_attention(kernel='triton') needs the inverse index (invert_chain_index)")

        return chain_attention_triton(q, k, v, index, valid, inverse, inverse_valid, scale)
    if kernel != "torch":
        raise ValueError(f"chain_attention: unknown kernel {kernel!r}; expected 'torch' or 'triton'")
    _, nh, Eq, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    C = index.shape[1]
    scale = hd ** -0.5 if scale is None else scale
    acc = acc_dtype(q.dtype)
    Ek = k.shape[2]
    kc = chain_gather(k[0].transpose(0, 1).reshape(Ek, nkv * hd), index, inverse, inverse_valid)
    vc = chain_gather(v[0].transpose(0, 1).reshape(Ek, nkv * hd), index, inverse, inverse_valid)
    # query-major layout: for one query row e and KV head n, its g query heads, C chain keys and hd
    # features are contiguous, so a kernel working on (e, n) reads each gathered key row once
    kc = kc.view(Eq, C, nkv, hd).permute(0, 2, 1, 3)  # [Eq, nkv, C, hd]
    vc = vc.view(Eq, C, nkv, hd).permute(0, 2, 1, 3)
    qg = q[0].transpose(0, 1).reshape(Eq, nkv, g, hd)  # head h = n * g + j reads KV head n
    ok = valid[:, None, None, :]  # [Eq, 1, 1, C], against scores [Eq, nkv, g, C]
    if torch.compiler.is_compiling():
        # Products summed over hd / C instead of a batched matmul: C <= K - 1 and g are tiny, so a
        # bmm runs as thousands of 8x8 tiles (about 40 ms of a 340 ms GPT-OSS-20B step on an H200,
        # docs/benchmarks.md). Inductor turns each product into one fused reduction that never
        # materialises the [Eq, nkv, C, g, hd] product; the scores are laid out [Eq, nkv, C, g]
        # (query heads innermost) so neighbouring outputs share their key row.
        s = (qg[:, :, None, :, :].to(acc) * kc[:, :, :, None, :].to(acc)).sum(-1) * scale  # [Eq, nkv, C, g]
        p, lse = _masked_softmax_lse(s.transpose(-1, -2), ok)  # softmax over C
        out = (p.transpose(-1, -2)[..., None] * vc[:, :, :, None, :].to(acc)).sum(2)  # [Eq, nkv, g, hd]
    else:  # eager: the same math as batched matmuls (the product above would be materialised)
        s = (qg @ kc.transpose(-1, -2)).to(acc) * scale  # [Eq, nkv, g, C]
        p, lse = _masked_softmax_lse(s, ok)
        out = p.to(v.dtype) @ vc  # [Eq, nkv, g, hd]
    out = out.reshape(Eq, nh, hd).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, nh, Eq, hd]
    return out, lse[..., 0].reshape(Eq, nh).transpose(0, 1).unsqueeze(0)


def dense_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Reference softmax attention under a dense bool mask, with its log-sum-exp. Materialises
    ``[nh, E_q, E_kv]`` scores: for tests and CPU checks only (eager FlexAttention has no CPU backward).

    Args:
        q: ``[1, nh, E_q, hd]``. k, v: ``[1, nkv, E_kv, hd]`` (GQA: head ``h`` reads ``h // (nh // nkv)``).
        mask: ``[E_q, E_kv]`` bool.

    Returns:
        ``(out [1, nh, E_q, hd], lse [1, nh, E_q])`` in ``q.dtype``, scale ``1 / sqrt(hd)``; rows without a
        key give ``out = 0``, ``lse = -inf`` and zero gradients.
    """
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p, lse = _masked_softmax_lse(s, mask)
    return p @ v, lse[..., 0]


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Exact softmax over the union of two disjoint key sets from each set's normalised output and lse.

    ``lse = logaddexp(lse_a, lse_b)``; ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
    The lse math runs in float32 for half inputs (float64 stays float64); a row where both lse are
    ``-inf`` (no key at all, e.g. padding) gives ``out = 0``, ``lse = -inf`` and zero, finite
    gradients (no ``-inf - -inf`` anywhere). Source: the log-sum-exp merge of partial softmaxes
    (FlashAttention's online softmax, Dao et al. 2022 §3.1), applied to the split of PEAGLE_SPEC §3.

    Args:
        out_a, out_b: ``[..., E, hd]`` (same shape and dtype). lse_a, lse_b: ``[..., E]`` natural log.

    Returns:
        ``(out [..., E, hd]`` in ``out_a.dtype``, ``lse [..., E]`` in the accumulation dtype``)``.
    """
    acc = acc_dtype(out_a.dtype)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb).detach()
    any_key = torch.isfinite(m)
    m = torch.where(any_key, m, torch.zeros_like(m))
    total = torch.exp(la - m) + torch.exp(lb - m)  # in [1, 2] where any_key, else 0
    lse_safe = torch.log(torch.where(any_key, total, torch.ones_like(total))) + m  # finite everywhere
    wa = torch.exp(la - lse_safe)[..., None]  # 0 where lse_a = -inf
    wb = torch.exp(lb - lse_safe)[..., None]
    out = (out_a * wa + out_b * wb).to(out_a.dtype)  # half * float32 promotes: summed in acc
    return out, torch.where(any_key, lse_safe, torch.full_like(lse_safe, float("-inf")))


_FLEX_COMPILED: dict = {}  # compiled flex_attention per ``dynamic=`` setting (kernels.compiling.DYNAMIC)


try:  # torch >= 2.7: ``return_aux=AuxRequest(lse=True)``; ``return_lse`` is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # older torch: only ``return_lse``
    _AuxRequest = None


#: Whether :func:`divisible_options` tells FlexAttention that the grid's lengths are multiples of 128 (the default);
#: False only to time a step without it (``benchmarks/train_step.py --divisible-hint off``)
DIVISIBLE_HINT = True


def divisible_options(kernel_options: dict | None, q, k) -> dict | None:
    """FlexAttention ``kernel_options`` with ``IS_DIVISIBLE: True`` added for CUDA inputs whose query and key lengths
    (``q.shape[-2]``, ``k.shape[-2]``) are both multiples of 128, unless ``kernel_options`` sets ``IS_DIVISIBLE``
    itself or asks for ``BACKEND: FLASH`` (FlashAttention-4's kernels, not Inductor's templates) or
    :data:`DIVISIBLE_HINT` is off; otherwise ``kernel_options`` unchanged. A new dict: the argument is never
    modified.

    Why: Inductor lowers FlexAttention with ``IS_DIVISIBLE`` true only where it can prove both lengths multiples of
    128 (``torch/_inductor/kernel/flex/flex_attention.py``: ``statically_known_true(Mod(seq_len, 128) == 0)``, set with
    ``setdefault``, so a given value wins). Under ``train.dynamic_shapes`` (the default) the lengths are symbols it
    cannot prove that of, and its kernels then take the bounds-checked path on every block, though the trainer pads
    every grid to a multiple of 1,024 (:func:`default_pad_multiple`). The test here is on the lengths themselves; in a
    compiled graph it becomes a guard on them, so a graph that takes the hint is used only for lengths that are
    multiples of 128. ``IS_DIVISIBLE`` is an option of Inductor's FlexAttention templates, not one of the documented
    ``FlexKernelOptions``; eager FlexAttention ignores it. ``q``, ``k``: tensors (only ``is_cuda`` and ``shape`` are
    read). Raises nothing."""
    if not DIVISIBLE_HINT or not q.is_cuda or (kernel_options and "IS_DIVISIBLE" in kernel_options):
        return kernel_options
    if kernel_options and kernel_options.get("BACKEND") == "FLASH":  # an option of the Triton templates only
        return kernel_options
    if q.shape[-2] % 128 != 0 or k.shape[-2] % 128 != 0:
        return kernel_options
    return {**(kernel_options or {}), "IS_DIVISIBLE": True}


def _flex_call(fn, q, k, v, block_mask, return_lse: bool, kernel_options: dict | None = None):
    """``fn`` = ``flex_attention`` (or its compiled form) → ``out``, or ``(out, lse)`` with
    ``return_lse`` (``lse [1, nh, E_q]`` natural log, float32 for half inputs, ``-inf`` on rows
    without any allowed key), through whichever lse API this torch has. ``kernel_options``:
    FlexAttention's (block sizes, stages, ...), passed on only when given, with ``IS_DIVISIBLE`` where
    :func:`divisible_options` adds it."""
    kernel_options = divisible_options(kernel_options, q, k)
    kw = {"block_mask": block_mask, "enable_gqa": True}
    if kernel_options:
        kw["kernel_options"] = kernel_options
    if not return_lse:
        return fn(q, k, v, **kw)
    if _AuxRequest is not None:
        out, aux = fn(q, k, v, **kw, return_aux=_AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, **kw, return_lse=True)


def _flex(q, k, v, block_mask, return_lse: bool = False, kernel_options: dict | None = None):
    """FlexAttention, compiled on CUDA (the fused kernel), eager elsewhere (tests / CPU; eager ignores the compiled
    kernels' block sizes, warps and stages; ``BACKEND: FLASH`` is dropped off CUDA, see the comment in the body).

    Returns ``out [1, nh, E_q, hd]``, or ``(out, lse)`` with ``return_lse`` (see :func:`_flex_call`).
    """
    from torch.nn.attention.flex_attention import flex_attention

    from peagle_train.kernels import compiling

    if kernel_options and not q.is_cuda and kernel_options.get("BACKEND") == "FLASH":
        # the FLASH backend is a CUDA kernel choice; eager FlexAttention given it on a CPU returns the same output
        # but its lse in base 2 (times log2(e)), so it is dropped here and the CPU computes the rule as flex_joint
        kernel_options = {n: v for n, v in kernel_options.items() if n != "BACKEND"} or None
    if torch.compiler.is_compiling():  # inside a compiled layer (train.compile): the layer's graph fuses it
        return _flex_call(flex_attention, q, k, v, block_mask, return_lse, kernel_options)
    if q.is_cuda:
        dynamic = compiling.DYNAMIC
        if dynamic not in _FLEX_COMPILED:
            # dynamic=False: one compiled kernel per bucketed grid length (see grid.pad_grid);
            # None: torch's automatic dynamic shapes, one recompile in all (train.dynamic_shapes)
            compiling.raise_recompile_limits()
            _FLEX_COMPILED[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
        return _flex_call(_FLEX_COMPILED[dynamic], q, k, v, block_mask, return_lse, kernel_options)
    return _flex_call(flex_attention, q, k, v, block_mask, return_lse, kernel_options)


@torch.compiler.disable
def _flex_compiled_apart(q, k, v, block_mask, **kw):
    """The prefix part run outside the calling layer's compiled graph (``train.prefix_compiled_apart``): Dynamo
    breaks the graph here and :func:`_flex_with_lse` (looked up at call time, as :func:`split_attention` does, so a
    test can swap in a dense reference) runs as it does uncompiled: on CUDA FlexAttention's own
    ``torch.compile(flex_attention)``, the kernel ``benchmarks/prefix_attention.py`` times alone, with Inductor's
    default mode (``train.compile: max-autotune`` does not autotune it here, as it does inside a layer); eager
    FlexAttention on a CPU. ``kw``: ``kernel_options=`` where given. Returns ``(out, lse)`` as :func:`_flex_with_lse`."""
    return _flex_with_lse(q, k, v, block_mask, **kw)


def _flex_with_lse(q, k, v, block_mask, kernel_options: dict | None = None):
    """Part A of the split form: FlexAttention over the prefix ``BlockMask`` → ``(out, lse)``
    (``kernel_options``: ``train.prefix_kernel_options``, passed on only when given)."""
    return _flex(q, k, v, block_mask, return_lse=True, kernel_options=kernel_options)


@dataclass
class AttnSpec:
    """How queries see keys; exactly one of:

    * ``block_mask``: one FlexAttention ``BlockMask`` of the whole rule (``train.attention: flex_joint``, and
      ``flex_flash`` with ``kernel_options`` :data:`FLASH_KERNEL_OPTIONS`);
    * ``split``: :class:`~peagle_train.peagle.masks.SplitMasks`, the prefix ``BlockMask`` + the chain
      index (``train.attention: flex``, the default on CUDA);
    * ``dense``: a dense bool mask ``[E_q, E_kv]`` for SDPA (CPU / small inputs / references).
    """

    block_mask: object | None = None
    dense: torch.Tensor | None = None
    split: SplitMasks | None = None
    #: FlexAttention ``kernel_options`` of the ``block_mask`` kernel as sorted ``(name, value)`` pairs, or None (its
    #: own choice): ``(("BACKEND", "FLASH"),)`` for ``train.attention: flex_flash`` (:data:`FLASH_KERNEL_OPTIONS`)
    kernel_options: tuple | None = None

    def __post_init__(self):
        given = [name for name in ("block_mask", "dense", "split") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"AttnSpec needs exactly one of block_mask, dense or split; got {given or 'none'}")
        if self.kernel_options is not None and self.block_mask is None:
            raise ValueError("AttnSpec.kernel_options applies to the block_mask kernel only (the split form takes "
                             "train.prefix_kernel_options through SplitMasks)")


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SplitMasks,
                    prefix_attention=None) -> torch.Tensor:
    """Attention under the split form of the rule (``attention.py``): prefix part + chain part,
    merged exactly by log-sum-exp.

    Args:
        q: ``[1, nh, E_q, hd]``. k, v: ``[1, nkv, E_kv, hd]``.
        split: the prefix ``BlockMask`` and the chain index of this (queries, keys) pair.
        prefix_attention: ``(q, k, v, prefix_mask) -> (out [1, nh, E_q, hd], lse [1, nh, E_q])``
            of the prefix part; None = FlexAttention (:func:`_flex_with_lse`, looked up at call time
            so tests can swap in a dense reference with a backward on CPU; called with
            ``kernel_options=`` as well where ``split.prefix_kernel_options`` is set, so a stand-in for it
            takes that keyword; options from ``auto`` only where :func:`auto_block_fits` ``q``'s head dimension and
            dtype). With ``split.prefix_compiled_apart`` and inside a compiled layer, FlexAttention runs behind a graph
            break (:func:`_flex_compiled_apart`).

    Returns:
        ``[1, nh, E_q, hd]`` in ``q.dtype``; 0 on rows that may attend nothing (padding).
    """
    options = prefix_options_to_run(split.prefix_kernel_options, split.prefix_kernel_options_auto, q.shape[-1],
                                    q.dtype)  # train.prefix_kernel_options
    kw = {"kernel_options": dict(options)} if options else {}  # passed only when given (stand-ins may lack it)
    if prefix_attention is not None:
        out_a, lse_a = prefix_attention(q, k, v, split.prefix_mask)
    elif split.prefix_compiled_apart and torch.compiler.is_compiling():  # train.prefix_compiled_apart
        out_a, lse_a = _flex_compiled_apart(q, k, v, split.prefix_mask, **kw)
    else:
        out_a, lse_a = _flex_with_lse(q, k, v, split.prefix_mask, **kw)
    if split.chain_index.shape[1] == 0:  # no query deeper than 0 (a static shape, not data)
        return out_a
    out_b, lse_b = chain_attention(q, k, v, split.chain_index, split.chain_valid,
                                   inverse=split.chain_inverse, inverse_valid=split.chain_inverse_valid,
                                   kernel=split.chain_kernel)
    return merge_by_lse(out_a, lse_a, out_b, lse_b)[0]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec) -> torch.Tensor:
    """``q [1, nh, Eq, hd]``, ``k/v [1, nkv, Ek, hd]`` → ``[1, nh, Eq, hd]``: split form, one
    joint FlexAttention kernel, or dense SDPA, as ``spec`` says."""
    if spec.split is not None:
        return split_attention(q, k, v, spec.split)
    if spec.block_mask is not None:
        return _flex(q, k, v, spec.block_mask,
                     kernel_options=dict(spec.kernel_options) if spec.kernel_options else None)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=spec.dense[None, None], enable_gqa=True)


def prefix_breaks_layer_graph(attention: str, prefix_compiled_apart: bool) -> bool:
    """Whether a compiled drafter layer has a graph break at its prefix attention: ``train.prefix_compiled_apart``
    with the split form (``attention == "flex"``, the only kind with a prefix part; :func:`split_attention`). Such
    layers compile with graph breaks allowed (``Drafter.set_compile(fullgraph=False)``). Raises nothing."""
    return bool(prefix_compiled_apart) and attention == "flex"


FLEX_KINDS = ("flex", "flex_joint", "flex_flash")  # FlexAttention kinds: compiled kernels specialise on the length

#: ``train.attention: flex_flash``: FlexAttention's ``BACKEND: FLASH``, the whole rule in one kernel run by
#: FlashAttention-4's CuTe DSL kernels (the ``flash-attn-4`` package) instead of Inductor's Triton templates. Those
#: kernels return no gradient through the log-sum-exp, which the split form's merge needs (:func:`merge_by_lse`), so
#: FLASH runs the joint rule (``flex_joint``'s ``BlockMask``), where the chain keys are a few extra blocks per query
#: block. On one H100 (3026d29) FLASH ran the grid's prefix mask at N = 65,536 in 895 ms forward + backward against
#: 1,359 ms for the best Triton kernel (398.9 against 262.8 TFLOP/s; docs/benchmarks.md, 'FlashAttention-4 through
#: FlexAttention on the grid's prefix').
FLASH_KERNEL_OPTIONS = (("BACKEND", "FLASH"),)


def flash_unavailable_reason(device: torch.device) -> str | None:
    """Why ``train.attention: flex_flash`` cannot run on ``device``, or None where it can: it needs a CUDA device of
    compute capability 9 or 10 (Hopper, Blackwell: the generations FlashAttention-4's CuTe kernels are built for;
    measured on 9.0) and the ``flash-attn-4`` package (module ``flash_attn.cute``; looking it up imports the parent
    package ``flash_attn``). Raises nothing: a device whose capability cannot be read or a package that fails to
    import is a reason too."""
    import importlib.util

    if device.type != "cuda":
        return f"it runs on CUDA only (device {device})"
    try:
        major = device_capability(device)[0]
    except (RuntimeError, AssertionError) as e:  # a torch without CUDA, no device of that index
        return f"the GPU's compute capability cannot be read ({e})"
    if major not in (9, 10):
        return f"FlashAttention-4's kernels need compute capability 9 or 10 (this GPU has {major}.x)"
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError as e:  # ModuleNotFoundError included; a parent package that fails to import
        return f"flash_attn.cute cannot be imported ({e}); install flash-attn-4"
    if not found:
        return "the flash-attn-4 package is not installed (pip install flash-attn-4)"
    return None


def make_attn_spec(q: GridMeta, kv: GridMeta | None = None, kind: str = "flex", min_chain: int = 0,
                   max_depth: int | None = None, chain_kernel: str = "auto",
                   prefix_kernel_options: str | dict | None = None, prefix_compiled_apart: bool = False) -> AttnSpec:
    """Attention spec for queries ``q`` over keys ``kv`` (default: same elements).

    ``kind="flex"``: split form, a prefix ``BlockMask`` + the chain index (``SplitMasks``;
    ``min_chain`` = at least this many chain slots, ``max_depth`` = the deepest depth known on the
    host, then no host sync; see :func:`~peagle_train.peagle.masks.build_chain_index`; ``chain_kernel``:
    ``auto``/``triton``/``torch``, how the chain part runs, :func:`~peagle_train.kernels.chain_kernel.resolve`;
    ``prefix_kernel_options``: ``train.prefix_kernel_options``, ``"auto"``, a mapping or None, resolved for the
    grid's device by :func:`build_split_masks`; ``prefix_compiled_apart``: ``train.prefix_compiled_apart``);
    ``"flex_joint"``: one ``BlockMask`` of the whole rule (no dense tensor either way);
    ``"flex_flash"``: the same ``BlockMask`` run by FlashAttention-4's kernels (:data:`FLASH_KERNEL_OPTIONS`; on a
    CPU eager FlexAttention computes the same rule, the option dropped by :func:`_flex`);
    ``"sdpa"``: dense bool mask ``[E_q, E_kv]`` (small inputs / reference). Raises ValueError for another kind.
    """
    if kind == "flex":
        return AttnSpec(split=build_split_masks(q, kv, min_chain=min_chain, max_depth=max_depth,
                                                chain_kernel=chain_kernel,
                                                prefix_kernel_options=prefix_kernel_options,
                                                prefix_compiled_apart=prefix_compiled_apart))
    if kind == "flex_joint":
        return AttnSpec(block_mask=build_block_mask(q, kv))
    if kind == "flex_flash":
        return AttnSpec(block_mask=build_block_mask(q, kv), kernel_options=FLASH_KERNEL_OPTIONS)
    if kind == "sdpa":
        return AttnSpec(dense=dense_mask(q, kv))
    raise ValueError(f"unknown attention kind {kind!r}")


def default_pad_multiple(attention: str) -> int:
    """Grid bucket: 1024 elements for FlexAttention kinds (bounded recompiles), none for dense SDPA."""
    return 1024 if attention in FLEX_KINDS else 1
