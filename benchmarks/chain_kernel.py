"""Chain part of the split attention: the Triton kernels (``peagle_train/kernels/chain_kernel.py``) against
the PyTorch chain part (``attention.chain_attention``, compiled as in a ``train.compile`` layer),
forward + backward on one grid of the chosen shape, with a sweep of the kernels' tiling.

Usage::

    python benchmarks/chain_kernel.py --shape gpt-oss-20b --N 8192 --out chain_kernel.json   # CUDA
    TRITON_INTERPRET=1 python benchmarks/chain_kernel.py --shape tiny --N 128 --repeats 2     # CPU smoke run

The grid is a COD sample of ``N`` supervised tokens (``--K``, ``--r``, ``--r-min``), padded to the
1024 bucket as the trainer pads it (``--pad-multiple``); q/k/v are random in ``--dtype``. Every row is the median of
``--repeats`` timed calls after one warm-up call (CUDA events on CUDA; wall clock elsewhere).
Rows: ``torch`` (forward + backward of the PyTorch chain part), ``triton`` (the same through the
kernels at the default :data:`~peagle_train.kernels.chain_kernel.TILING`), then one row per kernel
(``fwd``, ``bwd_q``, ``bwd_kv``) and tiling of the sweep (``--tiling ELEMS,WARPS ...``). The JSON
(``--out``) holds the rows and ``best_tiling``, the fastest tiling of each kernel, which
``benchmarks/train_step.py --chain-tiling FILE`` applies.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_step import SHAPES  # noqa: E402

import peagle_train.kernels.chain_kernel as ck  # noqa: E402
from peagle_train.kernels.attention import build_split_masks, chain_attention  # noqa: E402
from peagle_train.peagle.grid import build_grid, cod_sample, pad_grid  # noqa: E402
from peagle_train.peagle.masks import GridMeta  # noqa: E402

KERNELS = ("fwd", "bwd_q", "bwd_kv")


def timed(fn, repeats: int, device, around=None) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after one warm-up call. ``around``: a context manager
    entered after the warm-up and left after the timed calls (e.g. ``gpu_clocks.ClockSampler``: the compile of the
    warm-up call is not in what it samples)."""
    fn()
    times = []
    with around or contextlib.nullcontext():
        for _ in range(repeats):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def make_grid(N: int, K: int, r: float, r_min: float, generator: torch.Generator, pad_multiple: int = 1024):
    """The benchmark grid: a COD sample (``K`` depths, rates ``r``, ``r_min``) of ``N`` supervised tokens of one
    document, laid out depth-major and padded to a multiple of ``pad_multiple`` elements as the trainer pads it
    (:func:`~peagle_train.peagle.grid.pad_grid`); on the CPU. Draws from ``generator``."""
    ids = torch.randint(0, 100, (N,), generator=generator)
    mask = torch.ones(N, dtype=torch.bool)
    docs = torch.zeros(N, dtype=torch.long)
    kept = cod_sample(mask, docs, K, r, r_min, generator=generator)
    return pad_grid(build_grid(ids, mask, docs, kept, 100), pad_multiple)


def make_problem(shape: str, N: int, K: int, r: float, r_min: float, dtype, device, seed: int = 0,
                 pad_multiple: int = 1024):
    """One chain-attention problem at a benchmark shape (``train_step.SHAPES``).

    Returns:
        ``(split, q, k, v, go, gl)``: ``split`` the :class:`~peagle_train.peagle.masks.SplitMasks` of a COD
        grid of ``N`` supervised tokens (one document, ``K`` depths) padded to a multiple of
        ``pad_multiple`` elements (E, the padded length), chain part ``torch``; random
        ``q [1, nh, E, hd]`` (laid out ``[E, nh, hd]`` in memory, as the drafter's projections leave
        it), ``k, v [1, nkv, E, hd]`` and output cotangent ``go [1, nh, E, hd]``, all in ``dtype`` on
        ``device``; lse cotangent ``gl [1, nh, E]`` float32.

    Raises:
        KeyError: an unknown ``shape``.
    """
    s = SHAPES[shape]
    nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    g = torch.Generator().manual_seed(seed)
    grid = make_grid(N, K, r, r_min, g, pad_multiple)
    split = build_split_masks(GridMeta.of(grid.to(device)), min_chain=K - 1, max_depth=K - 1, chain_kernel="torch")
    E = len(grid)
    q = torch.randn(1, E, nh, hd, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(1, E, nkv, hd, generator=g).to(device, dtype).transpose(1, 2)
    v = torch.randn(1, E, nkv, hd, generator=g).to(device, dtype).transpose(1, 2)
    go = torch.randn(1, E, nh, hd, generator=g).to(device, dtype).transpose(1, 2)
    gl = torch.randn(1, nh, E, generator=g).to(device)
    return split, q, k, v, go, gl


def fwd_bwd(fn, q, k, v, go, gl, index, valid, inverse, inverse_valid, acc: torch.dtype = torch.float32):
    """One forward + backward of a chain-part function ``fn`` (``attention.chain_attention``'s signature)
    under the objective ``sum(out * go) + sum(lse * gl)`` (lse's ``-inf`` rows count 0), summed in ``acc``.

    Args:
        q ``[1, nh, E_q, hd]``, k/v ``[1, nkv, E_kv, hd]`` (detached views get the gradients); go like
        ``out``, gl like ``lse``; the chain index and its inverse as ``chain_attention`` takes them.

    Returns:
        ``(out, lse, dq, dk, dv)``, the gradients in the inputs' dtypes.
    """
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fn(qs, ks, vs, index, valid, inverse=inverse, inverse_valid=inverse_valid)
    obj = (out.to(acc) * go.to(acc)).sum() + (torch.where(torch.isfinite(lse), lse, 0).to(acc) * gl.to(acc)).sum()
    return (out, lse, *torch.autograd.grad(obj, (qs, ks, vs)))


def split_args(split) -> tuple:
    """``(index, valid, inverse, inverse_valid)`` of a :class:`~peagle_train.peagle.masks.SplitMasks`."""
    return split.chain_index, split.chain_valid, split.chain_inverse, split.chain_inverse_valid


def main(argv=None) -> list[dict]:
    """Command line (module docstring): times the rows, prints the table, writes ``--out``; returns the rows.

    Raises:
        SystemExit: the kernels cannot run on this machine (no Triton, or CPU without the interpreter).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pad-multiple", type=int, default=1024, help="grid bucket (the trainer's: 1024)")
    ap.add_argument("--tiling", nargs="*", default=["1024,2", "2048,2", "2048,4", "4096,4", "4096,8", "8192,4",
                                                      "8192,8", "16384,8"],
                    help="tilings of the sweep, ELEMS,WARPS each (peagle_train.kernels.chain_kernel.TILING)")
    ap.add_argument("--out", default="chain_kernel.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not ck.available(device):
        raise SystemExit(f"chain_kernel.py: the Triton kernels cannot run on {device} (install triton; on CPU set "
                         "TRITON_INTERPRET=1)")
    dtype = getattr(torch, args.dtype)
    split, q, k, v, go, gl = make_problem(args.shape, args.N, args.K, args.r, args.r_min, dtype, device,
                                          pad_multiple=args.pad_multiple)
    E, C = split.chain_index.shape
    rows = []
    torch_fn = chain_attention
    if device.type == "cuda":  # as in a compiled decoder layer (train.compile)
        torch_fn = torch.compile(chain_attention, fullgraph=True, dynamic=False)
    triton_fn = lambda *a, **kw: chain_attention(*a, **kw, kernel="triton")  # noqa: E731
    default = dict(ck.TILING)
    for name, fn in (("torch", torch_fn), ("triton", triton_fn)):
        ms = timed(lambda: fwd_bwd(fn, q, k, v, go, gl, *split_args(split)), args.repeats, device)
        rows.append({"impl": name, "kernel": "fwd+bwd", "tiling": default if name == "triton" else None, "ms": ms})
    # the kernels alone, per tiling: inputs of the backward from one forward
    scale = q.shape[-1] ** -0.5
    out, lse = torch.ops.peagle.chain_attention_fwd(q, k, v, split.chain_index, split.chain_valid,
                                                    split.chain_inverse, split.chain_inverse_valid, scale)
    _, ds, p = torch.ops.peagle.chain_attention_bwd_q(q, k, v, split.chain_index, split.chain_valid, out, go, lse,
                                                      gl, scale)
    calls = {
        "fwd": lambda: torch.ops.peagle.chain_attention_fwd(q, k, v, split.chain_index, split.chain_valid,
                                                            split.chain_inverse, split.chain_inverse_valid, scale),
        "bwd_q": lambda: torch.ops.peagle.chain_attention_bwd_q(q, k, v, split.chain_index, split.chain_valid, out,
                                                                go, lse, gl, scale),
        "bwd_kv": lambda: torch.ops.peagle.chain_attention_bwd_kv(q, go, k, split.chain_inverse,
                                                                  split.chain_inverse_valid, ds, p, scale),
    }
    best = {}
    try:  # every change of TILING below is undone, whatever fails
        for kern in KERNELS:
            for spec in args.tiling:
                elems, warps = (int(x) for x in spec.split(","))
                ck.TILING[kern] = (elems, warps)
                try:
                    ms = timed(calls[kern], args.repeats, device)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory / registers: report, go on
                    rows.append({"impl": "triton", "kernel": kern, "tiling": [elems, warps],
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                rows.append({"impl": "triton", "kernel": kern, "tiling": [elems, warps], "ms": ms})
                if kern not in best or ms < best[kern][1]:
                    best[kern] = ((elems, warps), ms)
            ck.TILING[kern] = default[kern]
        best_tiling = {kern: list(t) for kern, (t, _) in best.items()}
        ck.TILING.update({kern: tuple(t) for kern, t in best_tiling.items()})
        ms = timed(lambda: fwd_bwd(triton_fn, q, k, v, go, gl, *split_args(split)), args.repeats, device)
        rows.append({"impl": "triton", "kernel": "fwd+bwd", "tiling": best_tiling, "ms": ms})
    finally:
        ck.TILING.update(default)
    meta = {"shape": args.shape, "N": args.N, "K": args.K, "E": E, "C": C, "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "interpreter": ck.interpreting(), "torch": torch.__version__,
            "triton": getattr(ck.triton, "__version__", None), "repeats": args.repeats,
            "timing": f"median of {args.repeats} calls after 1 warm-up call",
            "torch_impl": "compiled (fullgraph)" if device.type == "cuda" else "eager"}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "best_tiling": best_tiling}, indent=1))
    print(f"\nchain part, {args.shape}, N={args.N} (E={E}, C={C}), {args.dtype}, {meta['device']}, {meta['timing']}")
    print(f"{'impl':>7} {'kernel':>8} {'tiling':>28} {'ms':>9}")
    for r in rows:
        t = r["tiling"] if not isinstance(r["tiling"], dict) else "default" if r["tiling"] == default else "best"
        val = f"{r['ms']:>9.3f}" if "ms" in r else r["error"]
        print(f"{r['impl']:>7} {r['kernel']:>8} {str(t):>28} {val}")
    ref = rows[0]["ms"]
    print(f"speedup vs torch: default tiling {ref / rows[1]['ms']:.2f}x, best {ref / rows[-1]['ms']:.2f}x; "
          f"best tiling {best_tiling}")
    return rows


if __name__ == "__main__":
    main()
