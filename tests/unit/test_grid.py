"""Pins the flattened N×K training grid and COD sampling (PEAGLE_SPEC §3, ``peagle_train/peagle/grid.py``).

* The worked example of ``grid.py``'s docstring, checked element by element.
* Layout on random packed inputs against a plain-Python reference: depth-major
  order, depth 0 = every anchor with a next token in its document, RoPE position
  ``anchor - doc_start + depth`` (restarts per packed document), input token
  ``x[a+1]`` at depth 0 and the mask id above, ``hidden_index`` (``-1`` = mask_hidden),
  ``label_index = a + 1 + d``, loss weights.
* ``pad_grid`` (bucketed lengths for compiled flex): padding elements are ``doc = -1``,
  weight 0, valid indices; real elements untouched.
* COD invariants (hypothesis): complete chains, per-depth counts
  ``min(floor(n_valid * max(r**d, r_min)), #candidates)`` (capped by ``max_anchors``),
  exact ``floor(...)`` when candidates suffice, no chain crosses a document or
  reaches padding / a non-loss token, seeded reproducibility.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle_train.peagle.grid import (
    build_grid,
    cod_keep_counts,
    cod_sample,
    doc_starts,
    pad_grid,
    supervised_count,
    valid_at_depth,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

MASK = 127


# ----------------------------------------------------------------------------- references


def ref_doc_start(doc_ids: list[int]) -> list[int]:
    out = []
    for i, d in enumerate(doc_ids):
        j = i
        while j > 0 and doc_ids[j - 1] == d:
            j -= 1
        out.append(j)
    return out


def ref_valid(loss_mask: list[bool], doc_ids: list[int], a: int, d: int) -> bool:
    """(a, d) is supervised iff x[a+2+d] exists, is in a's document, not padding, loss-valid."""
    j = a + 2 + d
    return j < len(doc_ids) and doc_ids[a] >= 0 and doc_ids[j] == doc_ids[a] and bool(loss_mask[j])


def packed_inputs(draw_lens, n_pad, loss_prob, seed, vocab=128):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(draw_lens)]
                        + [torch.full((n_pad,), -1, dtype=torch.int64)])
    N = doc_ids.numel()
    input_ids = torch.randint(0, vocab - 1, (N,), generator=g)
    loss_mask = (torch.rand(N, generator=g) < loss_prob) & (doc_ids >= 0)
    return input_ids, loss_mask, doc_ids


packed_case = st.fixed_dictionaries({
    "lens": st.lists(st.integers(1, 60), min_size=1, max_size=5),
    "n_pad": st.integers(0, 12),
    "loss_prob": st.sampled_from([0.3, 0.7, 1.0]),
    "seed": st.integers(0, 2**31 - 1),
    "K": st.integers(1, 10),
    "r": st.floats(0.3, 1.0),
    "r_min": st.floats(0.0, 1.0),
    "max_anchors": st.one_of(st.none(), st.integers(0, 40)),
})


# ----------------------------------------------------------------------------- worked example


def test_docstring_worked_example():
    """grid.py docstring: one doc, N = 6, loss-valid from index 2, K = 3, r = 1."""
    x = torch.tensor([10, 11, 12, 13, 14, 15])
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.bool)
    doc_ids = torch.zeros(6, dtype=torch.int64)
    kept = cod_sample(loss_mask, doc_ids, K=3, r=1.0, r_min=0.0, generator=torch.Generator().manual_seed(0))
    assert [k.tolist() for k in kept] == [[0, 1, 2, 3], [0, 1, 2], [0, 1]]
    g = build_grid(x, loss_mask, doc_ids, kept, mask_token_id=MASK)
    M = MASK
    assert g.anchor.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert g.depth.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert g.doc.tolist() == [0] * 10
    assert g.position_ids.tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 2, 3]
    assert g.token_ids.tolist() == [11, 12, 13, 14, 15, M, M, M, M, M]
    assert g.hidden_index.tolist() == [0, 1, 2, 3, 4, -1, -1, -1, -1, -1]
    # label row a+1+d predicts x[a+2+d]; (4, 0) has no label (x[6] does not exist) -> weight 0
    assert g.label_index.tolist() == [1, 2, 3, 4, 5, 2, 3, 4, 3, 4]
    assert g.loss_weight.tolist() == [1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    assert g.loss_weight.dtype == torch.float32
    assert supervised_count(g) == 9
    assert len(g) == 10


def test_packed_worked_example_positions_restart():
    """Two packed documents + padding: positions restart at the second document's start."""
    x = torch.arange(100, 111)
    doc_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1])
    loss_mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    kept = cod_sample(loss_mask, doc_ids, K=2, r=1.0, r_min=0.0)
    # depth 0 supervised: a with a+2 in the same doc -> 0,1 (doc 0), 4,5,6 (doc 1)
    assert kept[0].tolist() == [0, 1, 4, 5, 6]
    assert kept[1].tolist() == [0, 4, 5]
    g = build_grid(x, loss_mask, doc_ids, kept, mask_token_id=MASK)
    # depth 0: every anchor with a next token in its doc: 0,1,2 and 4,5,6,7 (never padding 9,10; never 3/8)
    assert g.anchor.tolist() == [0, 1, 2, 4, 5, 6, 7, 0, 4, 5]
    assert g.depth.tolist() == [0] * 7 + [1] * 3
    assert g.doc.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 1, 1]
    assert g.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 1, 1, 2]
    assert g.token_ids.tolist() == [101, 102, 103, 105, 106, 107, 108, MASK, MASK, MASK]
    assert g.loss_weight.tolist() == [1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert g.label_index.tolist()[7:] == [2, 6, 7]


def test_doc_starts_and_valid_at_depth_small():
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, -1, -1])
    assert doc_starts(doc_ids).tolist() == [0, 0, 0, 3, 3, 5, 6, 6]
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    assert valid_at_depth(loss_mask, doc_ids, 0).tolist() == [True, False, False, False, False, False, False, False]
    assert valid_at_depth(loss_mask, doc_ids, 5).tolist() == [False] * 8
    assert valid_at_depth(loss_mask[:2], doc_ids[:2], 0).tolist() == [False, False]


def test_cod_rejects_bad_K():
    with pytest.raises(ValueError):
        cod_sample(torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.int64), K=0, r=0.7, r_min=0.2)


def test_cod_keep_counts_formula():
    # literal spec formula in floating point (note 100 * 0.7**2 = 48.999... -> 48)
    assert cod_keep_counts(100, 5, 0.7, 0.2, None) == [100] + [math.floor(100 * max(0.7**d, 0.2)) for d in range(1, 5)]
    assert cod_keep_counts(100, 6, 0.5, 0.2, None) == [100, 50, 25, 20, 20, 20]
    assert cod_keep_counts(100, 4, 0.9, 0.2, 30) == [100, 30, 30, 30]
    assert cod_keep_counts(7, 1, 0.7, 0.2, None) == [7]


# ----------------------------------------------------------------------------- layout (random)


@settings(max_examples=40, deadline=None)
@given(case=packed_case)
def test_grid_layout_matches_reference(case):
    x, loss_mask, doc_ids = packed_inputs(case["lens"], case["n_pad"], case["loss_prob"], case["seed"])
    N = x.numel()
    K = case["K"]
    gen = torch.Generator().manual_seed(case["seed"])
    kept = cod_sample(loss_mask, doc_ids, K, case["r"], case["r_min"], case["max_anchors"], generator=gen)
    g = build_grid(x, loss_mask, doc_ids, kept, mask_token_id=MASK)
    dl, lm, xl = doc_ids.tolist(), loss_mask.tolist(), x.tolist()
    start = ref_doc_start(dl)
    assert doc_starts(doc_ids).tolist()[: sum(case["lens"])] == start[: sum(case["lens"])]
    for d in range(K):
        assert valid_at_depth(loss_mask, doc_ids, d).tolist() == [ref_valid(lm, dl, a, d) for a in range(N)]

    E = len(g)
    for f in ("anchor", "depth", "doc", "position_ids", "token_ids", "hidden_index", "label_index", "loss_weight"):
        assert getattr(g, f).shape == (E,)
    # depth-major, anchors strictly increasing inside each depth
    keys = list(zip(g.depth.tolist(), g.anchor.tolist()))
    assert keys == sorted(keys) and len(set(keys)) == E
    # depth 0: exactly the anchors with a next token in the same (real) document
    d0 = [a for a, dd in zip(g.anchor.tolist(), g.depth.tolist()) if dd == 0]
    assert d0 == [a for a in range(N - 1) if dl[a] >= 0 and dl[a + 1] == dl[a]]
    # depths >= 1: exactly the COD sample
    for d in range(1, K):
        got = sorted(a for dd, a in keys if dd == d)
        assert got == kept[d].tolist()
    for i in range(E):
        a, d = int(g.anchor[i]), int(g.depth[i])
        assert dl[a] >= 0 and g.doc[i] == dl[a]
        assert g.position_ids[i] == a - start[a] + d
        if d == 0:
            assert g.token_ids[i] == xl[a + 1]
            assert g.hidden_index[i] == a
            sup = ref_valid(lm, dl, a, 0)
            assert g.loss_weight[i] == float(sup)
            if sup:
                assert g.label_index[i] == a + 1
        else:
            assert g.token_ids[i] == MASK
            assert g.hidden_index[i] == -1
            assert g.loss_weight[i] == 1.0
            assert g.label_index[i] == a + 1 + d
        assert 0 <= g.label_index[i] < N
    assert supervised_count(g) == sum(ref_valid(lm, dl, a, 0) for a in range(N)) + sum(k.numel() for k in kept[1:])


# ----------------------------------------------------------------------------- COD invariants


@settings(max_examples=50, deadline=None)
@given(case=packed_case)
def test_cod_invariants(case):
    _, loss_mask, doc_ids = packed_inputs(case["lens"], case["n_pad"], case["loss_prob"], case["seed"])
    N = doc_ids.numel()
    K, r, r_min, cap = case["K"], case["r"], case["r_min"], case["max_anchors"]
    gen = torch.Generator().manual_seed(case["seed"])
    kept = cod_sample(loss_mask, doc_ids, K, r, r_min, cap, generator=gen)
    dl, lm = doc_ids.tolist(), loss_mask.tolist()
    assert len(kept) == K
    valid0 = [a for a in range(N) if ref_valid(lm, dl, a, 0)]
    assert kept[0].tolist() == valid0  # depth 0 keeps every loss-valid position
    n_valid = len(valid0)
    for d in range(1, K):
        k = kept[d].tolist()
        assert kept[d].dtype == torch.int64
        assert k == sorted(set(k))  # sorted, no duplicates
        prev = set(kept[d - 1].tolist())
        # chain complete: anchor kept at every shallower depth
        assert all(a in prev for a in k)
        # the whole chain (labels x[a+2..a+2+d]) stays in a's document, never padding, all loss-valid
        for a in k:
            for j in range(d + 1):
                assert dl[a] >= 0 and dl[a + 2 + j] == dl[a] and lm[a + 2 + j]
        cand = [a for a in prev if ref_valid(lm, dl, a, d)]
        target = math.floor(n_valid * max(r**d, r_min))
        if cap is not None:
            target = min(target, cap)
        assert len(k) == min(target, len(cand))
        if len(cand) >= target:
            assert len(k) == target
        if cap is not None:
            assert len(k) <= cap


@pytest.mark.parametrize("r,r_min,K", [(0.7, 0.2, 5), (0.8, 0.2, 6), (0.5, 0.0, 6)])
def test_cod_counts_exact_when_candidates_suffice(r, r_min, K):
    """Single all-loss-valid document: count is exactly floor(n_valid * max(r**d, r_min))."""
    N = 202
    loss_mask = torch.ones(N, dtype=torch.bool)
    doc_ids = torch.zeros(N, dtype=torch.int64)
    n_valid = N - 2
    expect = [n_valid] + [math.floor(n_valid * max(r**d, r_min)) for d in range(1, K)]
    # at most one kept anchor (a = N-2-d) loses its label per depth, so candidates suffice here
    assert all(expect[d - 1] - 1 >= expect[d] for d in range(1, K))
    for seed in range(5):
        kept = cod_sample(loss_mask, doc_ids, K, r, r_min, generator=torch.Generator().manual_seed(seed))
        assert [k.numel() for k in kept] == expect


def test_cod_max_anchors_caps_chains():
    N = 100
    kept = cod_sample(torch.ones(N, dtype=torch.bool), torch.zeros(N, dtype=torch.int64), 4, 0.9, 0.2,
                      max_anchors=7, generator=torch.Generator().manual_seed(0))
    assert [k.numel() for k in kept] == [98, 7, 7, 7]


def test_cod_seeded_reproducible_and_seed_dependent():
    x, loss_mask, doc_ids = packed_inputs([50, 40, 30], 5, 0.8, seed=3)
    def sample(seed):
        return [k.tolist() for k in cod_sample(loss_mask, doc_ids, 6, 0.7, 0.2,
                                               generator=torch.Generator().manual_seed(seed))]
    assert sample(11) == sample(11)
    others = [sample(s) for s in range(12, 17)]
    assert all(o != sample(11) for o in others)
    assert sample(11)[0] == others[0][0]  # depth 0 is deterministic (all loss-valid positions)


def test_build_grid_r1_keeps_every_chain():
    """r = r_min = 1: every supervised (a, d) is in the grid (used by the train/inference test)."""
    x, loss_mask, doc_ids = packed_inputs([20, 15], 3, 1.0, seed=0)
    K = 4
    kept = cod_sample(loss_mask, doc_ids, K, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
    dl, lm = doc_ids.tolist(), loss_mask.tolist()
    for d in range(K):
        assert kept[d].tolist() == [a for a in range(x.numel()) if all(ref_valid(lm, dl, a, j) for j in range(d + 1))]


def test_pad_grid():
    x, loss_mask, doc_ids = packed_inputs([9, 6], 2, 0.8, seed=1)
    kept = cod_sample(loss_mask, doc_ids, 3, 0.8, 0.2, generator=torch.Generator().manual_seed(0))
    g = build_grid(x, loss_mask, doc_ids, kept, mask_token_id=MASK)
    E = len(g)
    assert pad_grid(g, 1) is g and pad_grid(g, E) is g
    p = pad_grid(g, 16)
    assert len(p) % 16 == 0 and E < len(p) < E + 16
    fields = ("anchor", "depth", "doc", "position_ids", "token_ids", "hidden_index", "label_index", "loss_weight")
    for f in fields:
        a, b = getattr(g, f), getattr(p, f)
        assert b.dtype == a.dtype and torch.equal(b[:E], a), f
    assert (p.doc[E:] == -1).all() and (p.loss_weight[E:] == 0).all()
    N = x.numel()
    for f in ("anchor", "position_ids", "hidden_index", "label_index"):
        assert ((getattr(p, f)[E:] >= 0) & (getattr(p, f)[E:] < N)).all(), f
    assert supervised_count(p) == supervised_count(g)
