"""Which attention kernel should a regeneration decoding step use? (issue 19: regeneration >= 40K tokens/s)

One decoding step of a left-padded batch over a static KV cache: every row has one query per head, its
keys at positions ``[start_b, pos]`` of a cache of ``L`` positions (``start_b``: the row's left padding,
``pos``: the step's position, the cache after it not yet written). The profile of the static engine
(docs/benchmarks.md, "Regeneration on one H200") found this attention to be most of the 33-50 ms step at
batch 512, ~7x slower than reading the cache at the H200's bandwidth. This script times, for one layer of
the target's shape, the candidates on the same tensors and checks that each equals the float32 reference:

- ``sdpa_expanded``: transformers' SDPA path with a mask (``repeat_kv`` copies the grouped KV heads).
- ``sdpa_folded``: today's ``data_prep.gqa_decode_attention`` (the query heads of a group as query rows).
- ``sdpa_folded_efficient``: the same with PyTorch's memory-efficient kernel forced (not cuDNN's).
- ``bmm_bf16``: the folded step as two bf16 batched matmuls, float32 softmax.
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled; the decoding kernel for short queries),
  grouped heads natively, a block mask of each row's ``[start_b, pos]`` built per step (timed with it) so
  unwritten cache blocks are skipped.
- ``flex_mask_only``: that block mask's construction alone.
- ``triton_splitk_c<N>``: ``data_prep.decode_attention_kernel`` (``regen.decode_kernel: triton``), split-K
  over chunks of N positions, reading only each row's kept range (CUDA with Triton; an error row elsewhere).
- ``sdpa_nomask``: SDPA with grouped heads and no mask: not a correct step (it attends to padding and the
  unwritten tail), the floor of what a kernel reading the whole cache costs.

    python benchmarks/decode_attention_kernels.py --out docs/data/decode_attention_<commit>.json   # GPU
    python benchmarks/decode_attention_kernels.py --smoke                                          # CPU, tiny

Output JSON: ``meta`` (shape, device, torch, command) and ``rows``: per cache length ``L`` and filled
fraction, each variant's median ms over ``--iters`` steps (CUDA events), its bytes-read floor and max abs
error against the float32 reference (``null`` for ``sdpa_nomask``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_inputs(B: int, H: int, Hkv: int, D: int, L: int, fill: float, device, dtype, seed: int = 0):
    """Random query ``[B, H, 1, D]``, cache keys/values ``[B, Hkv, L, D]``, per-row ``start`` (left padding,
    int64 ``[B]``) and the step's position ``pos`` (int): rows' prompts end in the first ``L * fill`` positions."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, L, D, generator=g).to(device, dtype)
    pos = max(1, int(L * fill)) - 1
    start = torch.randint(0, max(1, pos // 4), (B,), generator=g).to(device)
    return q, k, v, start, pos


def bool_mask(start: torch.Tensor, pos: int, L: int) -> torch.Tensor:
    """``[B, L]`` bool: True where row b attends (``start_b <= j <= pos``)."""
    j = torch.arange(L, device=start.device)
    return (j[None, :] >= start[:, None]) & (j[None, :] <= pos)


def reference(q, k, v, start, pos):
    """float32 attention of the step: ``[B, H, 1, D]``."""
    B, H, _, D = q.shape
    g = H // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)
    vv = v.float().repeat_interleave(g, dim=1)
    s = (q.float() @ kk.transpose(-1, -2)) / D ** 0.5  # [B, H, 1, L]
    s = s.masked_fill(~bool_mask(start, pos, k.shape[2])[:, None, None, :], float("-inf"))
    return s.softmax(-1) @ vv


def sdpa_expanded(q, k, v, start, pos):
    """transformers' SDPA path: the grouped KV heads copied to ``[B, H, L, D]``, a bool mask ``[B, 1, 1, L]``.
    Inputs as :func:`make_inputs`; returns ``[B, H, 1, D]`` in ``q``'s dtype."""
    g = q.shape[1] // k.shape[1]
    m = bool_mask(start, pos, k.shape[2])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=m)


def sdpa_folded(q, k, v, start, pos):
    """``data_prep.gqa_decode_attention``'s step: the ``H / Hkv`` query heads of a group as query rows
    ``[B, Hkv, H/Hkv, D]`` over the uncopied ``[B, Hkv, L, D]`` cache; returns ``[B, H, 1, D]``."""
    B, H, _, D = q.shape
    hkv = k.shape[1]
    m = bool_mask(start, pos, k.shape[2])[:, None, None, :].expand(B, 1, H // hkv, k.shape[2])
    return F.scaled_dot_product_attention(q.reshape(B, hkv, H // hkv, D), k, v, attn_mask=m).reshape(B, H, 1, D)


def sdpa_folded_efficient(q, k, v, start, pos):
    """:func:`sdpa_folded` on PyTorch's memory-efficient kernel (RuntimeError where it cannot run the inputs,
    e.g. float32 on a CPU: recorded as an error row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return sdpa_folded(q, k, v, start, pos)


def bmm_bf16(q, k, v, start, pos):
    """The folded step as two batched matmuls in ``q``'s dtype, scores and softmax in float32
    (``[B, Hkv, H/Hkv, L]``); returns ``[B, H, 1, D]``."""
    B, H, _, D = q.shape
    hkv = k.shape[1]
    s = torch.matmul(q.reshape(B, hkv, H // hkv, D), k.transpose(-1, -2)).float() / D ** 0.5  # [B, Hkv, g, L]
    s = s.masked_fill(~bool_mask(start, pos, k.shape[2])[:, None, None, :], float("-inf"))
    return torch.matmul(s.softmax(-1).to(v.dtype), v).reshape(B, H, 1, D)


def make_triton(chunk: int):
    """``triton(q, k, v, start, pos)``: the split-K Triton kernel of ``data_prep.decode_attention_kernel`` with
    ``chunk`` positions per split, on the folded query heads and the step's bool mask; ``[B, H, 1, D]``."""
    from data_prep.decode_attention_kernel import gqa_decode_attention

    def triton_splitk(q, k, v, start, pos):
        B, H, _, D = q.shape
        hkv = k.shape[1]
        out = gqa_decode_attention(q.reshape(B, hkv, H // hkv, D), k, v, bool_mask(start, pos, k.shape[2]),
                                   D ** -0.5, chunk)
        return out.reshape(B, H, 1, D)

    return triton_splitk


def sdpa_nomask(q, k, v, start, pos):
    """SDPA with grouped heads and no mask over the whole cache: NOT the step (it attends to padding and the
    unwritten tail), the floor of a kernel that reads the whole cache; returns ``[B, H, 1, D]``."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def make_flex(compile_: bool, mask_only: bool = False):
    """``flex(q, k, v, start, pos)``: flex_attention with a per-step block mask of each row's valid keys
    (``mask_only``: the block mask alone, its share of the step)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fa = torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention

    def flex(q, k, v, start, pos):
        B, L = q.shape[0], k.shape[2]
        pos_t = torch.tensor(pos, device=q.device)

        def valid(b, h, q_idx, kv_idx):
            return (kv_idx >= start[b]) & (kv_idx <= pos_t)

        bm = create_block_mask(valid, B, None, 1, L, device=q.device)
        return bm if mask_only else fa(q, k, v, block_mask=bm, enable_gqa=True)

    return flex


def time_ms(fn, args, iters: int, cuda: bool) -> float:
    """Median ms of ``fn(*args)`` over ``iters`` calls after 3 warm-up calls (``chain_kernel.timed``: CUDA events
    on a GPU)."""
    from chain_kernel import timed

    fn(*args)
    fn(*args)  # + timed's own warm-up call: 3
    return timed(lambda: fn(*args), iters, torch.device("cuda" if cuda else "cpu"))


def main(argv=None) -> dict:
    """The command line (module docstring): times every variant per ``--lengths`` x ``--fills`` and returns the
    JSON written to ``--out`` (``meta``, ``rows``). A variant that raises is recorded as ``{"error": ...}``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[1152, 2560], help="static cache lengths L")
    p.add_argument("--fills", type=float, nargs="+", default=[0.5, 1.0], help="step position / L")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager flex: checks every variant")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.smoke:
        a.batch, a.lengths, a.iters = 4, [256], 2
    cuda = torch.cuda.is_available() and not a.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    variants = {"sdpa_expanded": sdpa_expanded, "sdpa_folded": sdpa_folded,
                "sdpa_folded_efficient": sdpa_folded_efficient, "bmm_bf16": bmm_bf16,
                "flex": make_flex(compile_=cuda), "flex_mask_only": make_flex(cuda, mask_only=True),
                **{f"triton_splitk_c{c}": make_triton(c) for c in (128, 256, 512)}, "sdpa_nomask": sdpa_nomask}
    rows = []
    for L in a.lengths:
        for fill in a.fills:
            q, k, v, start, pos = make_inputs(a.batch, a.heads, a.kv_heads, a.head_dim, L, fill, device, dtype)
            ref = reference(q, k, v, start, pos)
            kv_bytes = 2 * k.numel() * k.element_size()
            row = {"L": L, "fill": fill, "pos": pos, "kv_bytes_whole_cache": kv_bytes, "variants": {}}
            for name, fn in variants.items():
                try:
                    err = None if name in ("sdpa_nomask", "flex_mask_only") else float((fn(q, k, v, start, pos).float() - ref).abs().max())
                    row["variants"][name] = {"ms": time_ms(fn, (q, k, v, start, pos), a.iters, cuda), "max_abs_err": err}
                except Exception as e:  # a kernel this torch cannot run here: recorded, the others go on
                    row["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(L, fill, {n: (round(r["ms"], 3), r["max_abs_err"]) if "ms" in r else r["error"][:80]
                            for n, r in row["variants"].items()}, flush=True)
    from benchmarks.train_step import provenance

    args = list(sys.argv[1:] if argv is None else argv)
    res = {"meta": {**provenance(args, "benchmarks/decode_attention_kernels.py"),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
                    "head_dim": a.head_dim, "timing": f"median of {a.iters} calls after 3 warm-up calls"},
           "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
