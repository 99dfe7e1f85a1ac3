"""How sparse the P-EAGLE grid's FlexAttention block mask is (CPU, no GPU needed).

For one N-token sequence (every position loss-valid) with the default COD sample, builds the
depth-major grid padded as the trainer pads it (multiple of 1024), the block structure of
:func:`peagle_train.peagle.masks.block_structure` (128 x 128 blocks), and counts exactly the
(query, key) pairs the attention rule allows (in row chunks, never an E x E tensor). Prints a
table and writes JSON: blocks total / partial / full, pairs the kernel computes
(``(partial + full) * 128**2``) and their ratio to the allowed pairs, mean keys per query.

Usage::

    python benchmarks/mask_density.py --seq-len 8192 --out mask_density.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peagle_train.peagle.grid import build_grid, cod_sample, pad_grid  # noqa: E402
from peagle_train.peagle.masks import GridMeta, allowed, block_structure  # noqa: E402


def density(N: int, K: int = 8, r: float = 0.7, r_min: float = 0.2, seed: int = 0, block: int = 128,
            pad_multiple: int = 1024, rows: int = 2048) -> dict:
    """Block and pair counts of one grid's attention (see the module docstring).

    Returns:
        dict with ``elements`` (padded E), ``blocks_total``, ``blocks_partial``, ``blocks_full``,
        ``pairs_allowed``, ``pairs_computed``, ``computed_over_allowed``, ``keys_per_query``.
    """
    lm = torch.ones(N, dtype=torch.bool)
    doc = torch.zeros(N, dtype=torch.long)
    kept = cod_sample(lm, doc, K, r, r_min, generator=torch.Generator().manual_seed(seed))
    g = pad_grid(build_grid(torch.zeros(N, dtype=torch.long), lm, doc, kept, 1), pad_multiple)
    m = GridMeta.of(g)
    partial, full = block_structure(m, m, block)
    a, d, dc = m.anchor, m.depth, m.doc
    n_allowed = 0
    for s in range(0, len(m), rows):
        n_allowed += int(allowed(a[s:s + rows, None], d[s:s + rows, None], dc[s:s + rows, None],
                                 a[None, :], d[None, :], dc[None, :]).sum())
    computed = (int(partial.sum()) + int(full.sum())) * block * block
    real = int((dc >= 0).sum())
    return {"N": N, "K": K, "r": r, "r_min": r_min, "seed": seed, "elements": len(m),
            "blocks_total": partial.numel(), "blocks_partial": int(partial.sum()), "blocks_full": int(full.sum()),
            "pairs_allowed": n_allowed, "pairs_computed": computed,
            "computed_over_allowed": computed / max(1, n_allowed), "keys_per_query": n_allowed / max(1, real)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default="mask_density.json")
    args = ap.parse_args(argv)
    res = density(args.seq_len, args.K, args.r, args.r_min, args.seed)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
    return res


if __name__ == "__main__":
    main()
