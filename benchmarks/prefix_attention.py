"""Prefix part of the split attention at long contexts: FlexAttention over the grid's prefix ``BlockMask``
against the speed of the math on the same GPU, forward and forward + backward, with FlexAttention
``kernel_options`` variants.

Usage::

    python benchmarks/prefix_attention.py --N 65536 131072 --out prefix_attention.json          # CUDA
    python benchmarks/prefix_attention.py --shape tiny --N 256 --repeats 1 --out /tmp/p.json   # CPU smoke run
    python benchmarks/prefix_attention.py --options '{"BLOCK_M": 64, "BLOCK_N": 64}' ...       # + a variant row
    python benchmarks/prefix_attention.py --autotune ...                                       # + an autotuned row
    python benchmarks/prefix_attention.py --blocks-only --N 8192 65536 131072 262144           # tiling only (CPU)
    python benchmarks/prefix_attention.py --partitions 2 --N 131072 ...    # each of the trainer's 2 segments
    python benchmarks/prefix_attention.py --no-lse-grad --options '{"BACKEND": "FLASH"}' ...  # FlashAttention-4

At long N most of a step's work is this attention: 70 % of the N = 65,536 step's FLOPs, with every
layer's attention counted (``docs/data/flop_recount_af4cdbe.json``); this script times that kernel alone. The grid
is the one ``benchmarks/chain_kernel.py`` times (a COD sample of ``N`` supervised tokens of one
document, ``--K``, ``--r``, ``--r-min``, padded to the trainer's 1024 bucket), ``q [1, nh, E, hd]`` and
``k, v [1, nkv, E, hd]`` random in ``--dtype`` at the shape's heads (``train_step.SHAPES``); the
backward is that of ``sum(out * go) + sum(lse * gl)``, as the split form's log-sum-exp merge asks
for both gradients (``--no-lse-grad``: of ``sum(out * go)`` alone, the kernels called without ``lse``, for a
kernel that cannot differentiate through it, e.g. FlexAttention's ``BACKEND: FLASH``, FlashAttention-4's
CuTe kernels, given as ``--options '{"BACKEND": "FLASH"}'``; every row of such a run is timed that way, so
its rows compare with each other and not with a run's that has the ``lse`` gradient). Rows (median of ``--repeats`` calls after one warm-up call; CUDA events on CUDA,
wall clock elsewhere):

* ``flex`` / ``flex OPTIONS``: FlexAttention (compiled on CUDA, ``dynamic=False``; eager elsewhere)
  over the prefix ``BlockMask`` the trainer builds (``build_split_masks``), default or ``--options``
  kernel options;
* ``flex max-autotune`` (``--autotune``): the same, compiled with ``train.compile: max-autotune``'s Inductor
  options (``kernels.compiling.AUTOTUNE_OPTIONS``: block sizes, warps and stages benchmarked at the first call);
* ``flex_causal``: the same kernel over a plain causal ``BlockMask`` of the first ``N`` rows (the depth-0 part)
  (what FlexAttention does without the grid's mask);
* ``sdpa_causal``: ``scaled_dot_product_attention(is_causal=True)`` over those rows, heads repeated (the
  flash kernel on CUDA): the speed of the math for a causal prefix on this GPU.

The grid rows also say how the prefix ``BlockMask`` tiles the grid (:func:`block_counts`: full and
partial 128 × 128 blocks, and the fill, allowed pairs over the pairs of the visited blocks);
``--blocks-only`` gives only that, without a GPU.

FLOP per row: ``4 * nh * hd`` per (query, allowed key) pair forward, ``8 *`` backward (the
convention of ``train_step.py``'s ``12 * heads * head_dim * sum_q keys(q)``); the pairs of the grid
rows are ``sum_q (position - depth + 1)`` over real elements, of the causal rows ``N (N + 1) / 2``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chain_kernel import make_grid, timed  # noqa: E402
from gpu_clocks import ClockSampler, cuda_device_index, nvidia_smi_index  # noqa: E402
from train_step import SHAPES, provenance  # noqa: E402

from peagle_train.kernels import compiling  # noqa: E402
from peagle_train.kernels.attention import _flex_call  # noqa: E402
from peagle_train.peagle.grid import pad_grid
from peagle_train.peagle.masks import GridMeta, block_structure, build_block_mask  # noqa: E402
from peagle_train.peagle.partition import plan_partitions


def prefix_pairs(grid) -> int:
    """``sum_q (position - depth + 1)`` over the real elements of ``grid`` (``doc >= 0``): the
    (query, key) pairs of the prefix part (depth-0 keys at anchors ``0..a`` for query ``(a, d)``)."""
    real = grid.doc >= 0
    return int((grid.position_ids - grid.depth + 1)[real].sum())


def block_counts(grid, block_size: int = 128) -> dict:
    """How the prefix ``BlockMask`` of ``grid`` (padded to ``block_size``) tiles it: ``blocks_full`` (no
    mask evaluated), ``blocks_partial`` (the kernel evaluates the rule there) and ``block_fill``, the
    allowed pairs over the pairs of all visited blocks (1.0: no wasted work)."""
    meta = GridMeta.of(grid)
    meta = meta.padded(-(-len(meta) // block_size) * block_size)
    partial, full = block_structure(meta, meta, block_size, part="prefix")
    n_partial, n_full = int(partial.sum()), int(full.sum())
    return {"blocks_full": n_full, "blocks_partial": n_partial,
            "block_fill": prefix_pairs(grid) / max((n_full + n_partial) * block_size**2, 1)}


def causal_block_mask(n: int, device, block_size: int = 128):
    """FlexAttention ``BlockMask`` of plain causal attention over ``n`` rows (one document)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: k <= q, None, None, n, n, device=str(device), BLOCK_SIZE=block_size,
                             _compile=str(device).startswith("cuda"))  # compiled: no dense n x n mask


def objective_grads(fn, q, k, v, go, gl):
    """Forward + backward of ``fn(q, k, v) -> (out, lse)`` under ``sum(out * go) + sum(lse * gl)``
    (``lse``'s ``-inf`` rows count 0), summed in float32 → ``(dq, dk, dv)`` in the inputs' dtypes.
    ``q, go [1, nh, E, hd]``, ``k, v [1, nkv, E, hd]``, ``gl [1, nh, E]`` float32, or None: ``sum(out * go)``
    alone (``--no-lse-grad``; ``lse`` then takes no part in the graph)."""
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fn(qs, ks, vs)
    obj = (out.float() * go.float()).sum()
    if gl is not None:
        obj = obj + (torch.where(torch.isfinite(lse), lse, 0).float() * gl).sum()
    return torch.autograd.grad(obj, (qs, ks, vs))


def flex_fn(block_mask, options: dict | None, compiled, lse: bool = True):
    """``(q, k, v) -> (out, lse)`` of FlexAttention (``compiled``: its ``torch.compile`` form, or the eager
    function) over ``block_mask`` with ``kernel_options=options``. ``lse=False`` (``--no-lse-grad``): the kernel is
    called without ``return_lse`` and ``lse`` is None (a kernel that cannot differentiate through it, such as
    ``BACKEND: FLASH``, is then asked for nothing it refuses)."""
    def fn(q, k, v):
        res = _flex_call(compiled, q, k, v, block_mask, return_lse=lse, kernel_options=options)
        return res if lse else (res, None)
    return fn


def sdpa_causal_fn(q, k, v):
    """Causal SDPA, ``q [1, nh, N, hd]``, ``k, v [1, nkv, N, hd]`` → ``(out [1, nh, N, hd], lse [1, nh, N]
    float32)`` (``lse`` zeros: SDPA does not return it; its cotangent then adds
    nothing to the backward). The KV heads are repeated to the query heads first, so that the flash
    kernel takes it on CUDA (a grouped-head call may fall back to the math kernel, whose ``N × N``
    scores do not fit at long N)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out, torch.zeros(out.shape[:-1], device=out.device)


def recompiles_needed(cases: int) -> int:
    """Compiled ``flex_attention`` variants one ``N`` can ask for: per case its forward with and without
    grad and its backward (3), with room for a guard change each (x 2), plus 8 spare. Measured need: a run
    with three option sets (six cases) hit the default limit of 8 at its causal row, which then ran eagerly and
    ran out of memory (``docs/data/prefix_attention_7a2a50b_h100_65536_options.json``)."""
    return 6 * cases + 8


def rows_for_n(shape: str, N: int, args, device, dtype, option_sets: list, on_row=None) -> list[dict]:
    """Every row of one ``N`` (module docstring). A row that fails (e.g. a kernel option the GPU
    cannot compile) keeps its error and the others still run. With ``args.partitions`` S > 1 the grid rows are
    those of each segment (:func:`segment_grids`). ``on_row(row)``: called as each row ends (``main`` writes the rows
    so far, so a kernel that kills the process loses only its own row)."""
    s = SHAPES[shape]
    g = torch.Generator().manual_seed(args.seed)
    full = make_grid(N, args.K, args.r, args.r_min, g, args.pad_multiple)
    parts = [("", full)] if args.partitions == 1 else segment_grids(full, N, args.partitions, args.pad_multiple)
    if args.blocks_only:
        rows = [{"N": N, "E": len(grid), "pairs": prefix_pairs(grid), "impl": "flex" + label, **block_counts(grid)}
                for label, grid in parts]
        for row in rows if on_row is not None else ():
            on_row(row)
        return rows
    rows = []
    for i, (label, grid) in enumerate(parts):  # the causal references once, with the last part
        rows += _timed_rows(N, grid, label, s, args, device, dtype, option_sets, g, references=i == len(parts) - 1,
                            on_row=on_row)
    return rows


def segment_grids(grid, N: int, S: int, pad_multiple: int) -> list[tuple[str, object]]:
    """The trainer's ``S`` partition segments of ``grid`` (``plan_partitions``, then ``Segment.apply``, padded
    to ``pad_multiple`` as ``PEagleObjective`` pads each one), labelled ``" segment i/S"``: segment ``i`` holds
    the rows it supervises and, from the second on, the depth-0 context copies of the earlier anchors, whose
    pairs it computes again (rule 4 of the partitioning, ``peagle_train.peagle.partition``)."""
    return [(f" segment {i}/{S}", pad_grid(seg.apply(grid), pad_multiple))
            for i, seg in enumerate(plan_partitions(grid, N, S))]


def _timed_rows(N: int, grid, label: str, s: dict, args, device, dtype, option_sets: list, g,
                references: bool, on_row=None) -> list[dict]:
    """The timed rows of one grid (the whole grid or one segment, ``label``); with ``references`` the
    causal rows of the first ``N`` rows of ``grid`` as well (module docstring); ``on_row`` as in :func:`rows_for_n`."""
    from torch.nn.attention.flex_attention import flex_attention

    nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    E = len(grid)
    blocks = block_counts(grid)
    mask = build_block_mask(GridMeta.of(grid.to(device)), part="prefix")
    q = torch.randn(1, E, nh, hd, generator=g).to(device, dtype).transpose(1, 2)
    k = torch.randn(1, E, nkv, hd, generator=g).to(device, dtype).transpose(1, 2)
    v = torch.randn(1, E, nkv, hd, generator=g).to(device, dtype).transpose(1, 2)
    go = torch.randn(1, E, nh, hd, generator=g).to(device, dtype).transpose(1, 2)
    gl = torch.randn(1, nh, E, generator=g).to(device)
    cuda = device.type == "cuda"
    flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    d0 = slice(0, N)  # depth-major: the first N rows (the N - 1 depth-0 elements and one more), a causal problem
    # of the prefix's length for the two reference rows
    q0, k0, v0, go0 = q[:, :, d0], k[:, :, d0], v[:, :, d0], go[:, :, d0]
    grid_pairs, causal_pairs = prefix_pairs(grid), N * (N + 1) // 2
    with_lse = not args.no_lse_grad
    if not with_lse:
        gl = None  # --no-lse-grad: sum(out * go) alone, every row (objective_grads)
    gl0 = None if gl is None else gl[:, :, d0]
    cases = [((f"flex {json.dumps(o, sort_keys=True)}" if o else "flex") + label, flex_fn(mask, o, flex, with_lse),
              (q, k, v, go, gl), grid_pairs, o) for o in option_sets]
    if args.autotune:  # compiled under train.compile: max-autotune's Inductor options (the forward and backward
        # kernels' block sizes, warps and stages benchmarked at its first call)
        tuned = (torch.compile(flex_attention, dynamic=False, **compiling.compile_kwargs(compiling.AUTOTUNE))
                 if cuda else flex_attention)
        cases.append(("flex max-autotune" + label, flex_fn(mask, None, tuned, with_lse), (q, k, v, go, gl), grid_pairs,
                      None))
    grid_rows = {name for name, *_ in cases}
    if references:
        cases += [("flex_causal", flex_fn(causal_block_mask(N, device), None, flex, with_lse), (q0, k0, v0, go0, gl0),
                   causal_pairs, None),
                  ("sdpa_causal", sdpa_causal_fn, (q0, k0, v0, go0, gl0), causal_pairs, None)]
    # every case recompiles flex_attention (its options or mask, forward and backward, grad on and off); past
    # dynamo's recompile limit (default 8) it runs eagerly and materialises the E x N scores (1 TiB at N = 65,536)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               recompiles_needed(len(cases) * args.partitions))
    rows = []
    for name, fn, (qq, kk, vv, gg, ll), pairs, opts in cases:
        row = {"N": N, "E": E, "rows": int(qq.shape[2]), "pairs": pairs, "impl": name, "kernel_options": opts,
               "lse_grad": with_lse, **(blocks if name in grid_rows else {})}
        fl = 4 * nh * hd * pairs
        # the card's clocks over the row's timed calls (CUDA; None without nvidia-smi), sampled after timed's warm-up
        # call (which compiles): beside train_step.py's over its steps, a kernel slower in the step than alone is
        # told apart from a card that slowed down
        clocks = ClockSampler(nvidia_smi_index(cuda_device_index(device))) if cuda else None
        try:
            with torch.no_grad():
                fwd = timed(lambda: fn(qq, kk, vv), args.repeats, device, around=clocks)  # noqa: B023 - this iteration
        except Exception as e:  # noqa: BLE001 - report and go on (out of shared memory, unsupported option)
            rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:300]}"))
            if on_row is not None:
                on_row(rows[-1])
            continue
        row.update(fwd_ms=fwd, fwd_tflops=fl / fwd / 1e9, fwd_bwd_ms=None, fwd_bwd_tflops=None,
                   fwd_gpu_clocks=None if clocks is None else clocks.summary(), fwd_bwd_gpu_clocks=None)
        try:  # (eager FlexAttention has no backward on CPU: the smoke run's flex rows are forward only)
            both = timed(lambda: objective_grads(fn, qq, kk, vv, gg, ll), args.repeats, device,  # noqa: B023
                         around=clocks)
            row.update(fwd_bwd_ms=both, fwd_bwd_tflops=3 * fl / both / 1e9,
                       fwd_bwd_gpu_clocks=None if clocks is None else clocks.summary())
        except Exception as e:  # noqa: BLE001
            row["fwd_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def main(argv=None) -> list[dict]:
    """Command line (module docstring): times the rows, prints them, writes ``--out``; returns the rows.

    Raises:
        SystemExit: an ``--options`` value that is not a JSON object.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--N", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pad-multiple", type=int, default=1024, help="grid bucket (the trainer's: 1024)")
    ap.add_argument("--options", nargs="*", default=[],
                    help="FlexAttention kernel_options variants, a JSON object each (one row each beside the default)")
    ap.add_argument("--autotune", action="store_true",
                    help="one more grid row: FlexAttention compiled as train.compile: max-autotune compiles it")
    ap.add_argument("--blocks-only", action="store_true",
                    help="no timing: each N's grid, pair count and BlockMask tiling only (runs at any N on a CPU)")
    ap.add_argument("--partitions", type=int, default=1,
                    help="S > 1: the trainer's S partition segments of each grid instead of the whole grid, a row "
                         "each (the prefix attention a step with train.partitions S runs, context copies included)")
    ap.add_argument("--no-lse-grad", action="store_true",
                    help="backward of sum(out * go) alone, the kernels called without lse (every row): for kernels "
                         "that cannot differentiate through lse, e.g. --options '{\"BACKEND\": \"FLASH\"}'")
    ap.add_argument("--out", default="prefix_attention.json")
    args = ap.parse_args(argv)
    if args.partitions < 1:
        raise SystemExit(f"prefix_attention.py: --partitions must be >= 1 (got {args.partitions})")
    option_sets: list = [None]
    for o in args.options:
        try:
            parsed = json.loads(o)
        except json.JSONDecodeError as e:
            raise SystemExit(f"prefix_attention.py: --options {o!r} is not JSON ({e}); give an object such as "
                             "'{\"BLOCK_M\": 64, \"BLOCK_N\": 64}'") from e
        if not isinstance(parsed, dict):
            raise SystemExit(f"prefix_attention.py: --options {o!r} is not a JSON object of kernel options")
        option_sets.append(parsed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    meta = {**provenance(sys.argv[1:] if argv is None else argv, "benchmarks/prefix_attention.py"),
            "shape": args.shape, "K": args.K, "r": args.r, "r_min": args.r_min, "dtype": args.dtype,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "timing": None if args.blocks_only else f"median of {args.repeats} calls after 1 warm-up call",
            "flex": "torch.compile(flex_attention, dynamic=False)" if device.type == "cuda" else "eager",
            "flop": "4 * heads * head_dim per (query, key) pair forward, 8 * backward",
            "backward_of": "sum(out * go)" if args.no_lse_grad else "sum(out * go) + sum(lse * gl)"}
    rows: list[dict] = []

    def write(row=None):  # the rows so far, replacing the file whole (a killed run leaves the last complete one)
        if row is not None:
            rows.append(row)
        tmp = Path(str(args.out) + ".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        os.replace(tmp, args.out)

    for N in args.N:
        rows_for_n(args.shape, N, args, device, dtype, option_sets, on_row=write)
    write()
    if args.blocks_only:
        print(f"\nprefix BlockMask of the grid, {args.shape}, K = {args.K}, r = {args.r}, r_min = {args.r_min}")
    else:
        print(f"\nprefix attention, {args.shape}, {args.dtype}, {meta['device']}, {meta['timing']}")
        print(f"{'N':>7} {'impl':>36} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for r in rows:
        if args.blocks_only:
            print(f"{r['N']:>7} {r['impl']:>16} E {r['E']}: {r['pairs']:,} pairs, {r['blocks_full']:,} full and "
                  f"{r['blocks_partial']:,} partial blocks, fill {r['block_fill']:.3f}")
        elif "error" in r:
            print(f"{r['N']:>7} {r['impl'][:36]:>36}  {r['error'][:80]}")
        else:
            both = (f"{r['fwd_bwd_ms']:>11.2f} {r['fwd_bwd_tflops']:>8.1f}" if r["fwd_bwd_ms"] is not None
                    else f"  backward: {r['fwd_bwd_error'][:60]}")
            print(f"{r['N']:>7} {r['impl'][:36]:>36} {r['fwd_ms']:>9.2f} {r['fwd_tflops']:>8.1f} {both}")
    return rows


if __name__ == "__main__":
    main()
