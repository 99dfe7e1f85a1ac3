"""Pins the split form of the grid attention rule (PEAGLE_SPEC §3; ``attention.py``, ``drafter.split_attention``).

The rule is the disjoint union of a *prefix* part (``dk == 0 and ak <= aq``) computed by
FlexAttention with its own ``BlockMask``, and a *chain* part (``ak == aq and 1 <= dk <= dq``)
computed from a gathered index of at most ``C = K - 1`` keys per query; the two softmaxes are
merged exactly by log-sum-exp.

* The parts are disjoint and their union is ``dense_mask`` (hypothesis: packed documents,
  trailing padding, COD samples, K up to 10; Q == KV grids, partition segments, EAGLE-3's step-k
  queries over the concatenated keys of steps ≤ k, random query subsets, random shuffled key subsets).
* The prefix ``BlockMask`` ≡ the dense prefix mask at element level (full blocks + ``mask_mod`` on
  partial blocks), and blocks holding only depth ≥ 1 keys are skipped.
* ``build_chain_index`` ≡ a plain-Python lookup, for any key order; duplicate keys are refused.
* float64: forward and gradients (q, k, v) of the split attention ≡ SDPA with ``dense_mask``
  (1e-12), with the prefix part computed densely from the prefix ``BlockMask`` (eager flex has no
  CPU backward); rows that may attend nothing (padding) give 0 and zero, finite gradients. The
  same through the whole P-EAGLE objective (loss and every parameter gradient vs SDPA).
* float32 with the real (eager, CPU) FlexAttention: ``attend`` and the ``Drafter`` / objectives'
  forward ≡ SDPA and ≡ the joint single-BlockMask kernel (1e-5); flex's lse is natural-log.
* ``merge_by_lse`` alone (dtypes, -inf rows); the split layer traces with ``fullgraph=True``
  (``train.compile``); building the split spec of an 8192 × 8 grid stays far below E² memory.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cc
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import peagle_train.kernels.attention as attention_mod
from peagle_train.kernels.attention import (
    AttnSpec,
    attend,
    build_split_masks,
    chain_attention,
    chain_gather,
    dense_attention_with_lse,
    make_attn_spec,
    merge_by_lse,
    split_attention,
)
from peagle_train.methods.peagle import PEagleObjective
from peagle_train.peagle.grid import pad_grid
from peagle_train.peagle.masks import (
    GridMeta,
    SplitMasks,
    block_structure,
    build_block_mask,
    build_chain_index,
    dense_mask,
    invert_chain_index,
)
from peagle_train.peagle.partition import plan_partitions
from tests.unit.test_attention import (
    cat_meta,
    decode_blocks,
    grid_case,
    make_grid,
    manual_attention,
    ref_dense,
    sub_meta,
)

pytestmark = [pytest.mark.usefixtures("torch_single_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

# ----------------------------------------------------------------------------- helpers


def ref_prefix(qa, qd, qdoc, ka, kd, kdoc) -> bool:
    return qdoc >= 0 and qdoc == kdoc and kd == 0 and ka <= qa


def ref_chain(qa, qd, qdoc, ka, kd, kdoc) -> bool:
    return qdoc >= 0 and qdoc == kdoc and ka == qa and 1 <= kd <= qd


def ref_chain_index(q: GridMeta, kv: GridMeta, C: int):
    """Plain-Python transcription: slot j-1 of query (aq, dq, docq) = the key (aq, j) of the same document."""
    where = {}
    for i, (a, d, doc) in enumerate(zip(kv.anchor.tolist(), kv.depth.tolist(), kv.doc.tolist())):
        if doc >= 0 and d >= 1:
            where[(a, d)] = (i, doc)
    index = torch.zeros(len(q), C, dtype=torch.int64)
    valid = torch.zeros(len(q), C, dtype=torch.bool)
    for r, (a, d, doc) in enumerate(zip(q.anchor.tolist(), q.depth.tolist(), q.doc.tolist())):
        for j in range(1, C + 1):
            hit = where.get((a, j))
            if doc >= 0 and j <= d and hit is not None and hit[1] == doc:
                index[r, j - 1], valid[r, j - 1] = hit[0], True
    return index, valid


def effective_mask(bm, Eq: int, Ek: int) -> torch.Tensor:
    """What the kernel computes for a BlockMask: full blocks, plus ``mask_mod`` inside partial blocks."""
    bq, bk = bm.BLOCK_SIZE
    nkb = -(-Ek // bk)
    partial = decode_blocks(bm.kv_num_blocks, bm.kv_indices, nkb)
    full = decode_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, nkb)
    blk_q, blk_k = torch.arange(Eq) // bq, torch.arange(Ek) // bk
    mm = create_mask(bm.mask_mod, 1, 1, Eq, Ek, device="cpu")[0, 0]
    return full[blk_q][:, blk_k] | (partial[blk_q][:, blk_k] & mm)


def dense_prefix_attention(q, k, v, prefix_mask):
    """Drop-in for the flex prefix part: the prefix BlockMask's effective mask, computed densely."""
    return dense_attention_with_lse(q, k, v, effective_mask(prefix_mask, q.shape[2], k.shape[2]))


def pick_pair(g, N: int, data, S_max: int = 4):
    """A (queries, keys) pair of one of the shapes the trainer produces, or a harder one."""
    m = GridMeta.of(g)
    K = int(g.depth.max()) + 1
    kind = data.draw(st.sampled_from(["self", "eagle3", "segment", "q_subset", "kv_subset"]), label="kind")
    if kind == "self":
        return m, m
    if kind == "eagle3":  # step-k queries over the concatenated keys of steps 0..k
        k = data.draw(st.integers(0, K - 1), label="step")
        steps = [sub_meta(m, (g.depth == j).nonzero().flatten()) for j in range(k + 1)]
        return steps[-1], cat_meta(*steps)
    if kind == "segment":  # one partition segment attends within itself
        S = data.draw(st.integers(1, min(S_max, N)), label="S")
        segs = plan_partitions(g, N, S)
        seg = segs[data.draw(st.integers(0, S - 1), label="seg")]
        sm = sub_meta(m, seg.index)
        return sm, sm
    rows = sorted(data.draw(st.sets(st.integers(0, len(m) - 1), min_size=1, max_size=len(m)), label="rows"))
    sel = torch.tensor(rows)
    if kind == "q_subset":
        return sub_meta(m, sel), m
    # a random subset of the keys in a random order: rows with only chain keys, only prefix keys, none
    perm = torch.randperm(sel.numel(), generator=torch.Generator().manual_seed(len(rows)))
    return m, sub_meta(m, sel[perm])


def maybe_pad(q: GridMeta, kv: GridMeta, data):
    if data.draw(st.booleans(), label="pad"):
        extra = data.draw(st.integers(1, 20), label="extra")
        return q.padded(len(q) + extra), kv.padded(len(kv) + extra // 2 + 1)
    return q, kv


def case_pair(case, data, K: int | None = None, S_max: int = 4):
    """A (queries, keys) pair of the hypothesis ``grid_case`` (:func:`pick_pair`, :func:`maybe_pad`)."""
    g, x = make_grid(case["lens"], case["n_pad"], case["loss_prob"], case["K"] if K is None else K, case["r"],
                     case["r_min"], case["max_anchors"], case["seed"])
    return maybe_pad(*pick_pair(g, x.numel(), data, S_max=S_max), data)


# ----------------------------------------------------------------------------- masks


@settings(max_examples=60, deadline=None)
@given(case=grid_case, data=st.data())
def test_prefix_and_chain_partition_the_rule(case, data):
    q, kv = case_pair(case, data)
    full = dense_mask(q, kv)
    prefix, chain = dense_mask(q, kv, part="prefix"), dense_mask(q, kv, part="chain")
    assert not (prefix & chain).any()
    assert torch.equal(prefix | chain, full)
    if len(q) * len(kv) <= 40_000:
        assert torch.equal(prefix, ref_dense(q, kv, ref_prefix))
        assert torch.equal(chain, ref_dense(q, kv, ref_chain))

    # prefix BlockMask ≡ dense prefix mask at element level
    bs = case["block_size"]
    bm = build_block_mask(q, kv, block_size=bs, part="prefix")
    assert tuple(bm.seq_lengths) == (len(q), len(kv)) and tuple(bm.BLOCK_SIZE) == (bs, bs)
    nqb, nkb = -(-len(q) // bs), -(-len(kv) // bs)
    part_b = decode_blocks(bm.kv_num_blocks, bm.kv_indices, nkb)
    full_b = decode_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, nkb)
    assert not (part_b & full_b).any()
    assert torch.equal(decode_blocks(bm.q_num_blocks, bm.q_indices, nqb), part_b.T)
    assert torch.equal(decode_blocks(bm.full_q_num_blocks, bm.full_q_indices, nqb), full_b.T)
    mm = create_mask(bm.mask_mod, 1, 1, len(q), len(kv), device="cpu")[0, 0]
    assert torch.equal(mm, prefix)
    blk_q, blk_k = torch.arange(len(q)) // bs, torch.arange(len(kv)) // bs
    assert not (full_b[blk_q][:, blk_k] & ~prefix).any(), "full block with a disallowed pair"
    assert torch.equal(effective_mask(bm, len(q), len(kv)), prefix)
    # blocks without a real depth-0 key are skipped (in the depth-major grid: everything past depth 0)
    kd0 = torch.zeros(nkb, dtype=torch.bool).index_put_((blk_k,), (kv.depth == 0) & (kv.doc >= 0), accumulate=True)
    assert not (part_b | full_b)[:, ~kd0].any()

    # chain index ≡ dense chain mask
    index, valid = build_chain_index(q, kv)
    as_mask = torch.zeros(len(q), len(kv), dtype=torch.bool)
    rows = torch.arange(len(q))[:, None].expand_as(index)
    as_mask[rows[valid], index[valid]] = True
    assert torch.equal(as_mask, chain)
    assert int(valid.sum()) == int(chain.sum())  # no key twice


@settings(max_examples=60, deadline=None)
@given(case=grid_case, data=st.data())
def test_chain_index_equals_python_reference(case, data):
    q, kv = case_pair(case, data)
    min_chain = data.draw(st.integers(0, 10), label="min_chain")
    index, valid = build_chain_index(q, kv, min_chain=min_chain)
    deepest = int(torch.where(q.doc >= 0, q.depth, 0).max())
    C = max(min_chain, deepest)
    assert index.shape == valid.shape == (len(q), C) and index.dtype == torch.int64 and valid.dtype == torch.bool
    ref_i, ref_v = ref_chain_index(q, kv, C)
    assert torch.equal(valid, ref_v)
    assert torch.equal(index, ref_i)  # 0 on invalid slots
    # the host-sync-free form: width from max_depth, checks on the device (at once on CPU)
    max_depth = deepest + data.draw(st.integers(0, 2), label="max_depth slack")
    index2, valid2 = build_chain_index(q, kv, min_chain=min_chain, max_depth=max_depth)
    ref_i, ref_v = ref_chain_index(q, kv, max(min_chain, max_depth))
    assert torch.equal(valid2, ref_v) and torch.equal(index2, ref_i)
    if deepest > 0:
        with pytest.raises(RuntimeError, match=f"deeper than max_depth={deepest - 1}"):
            build_chain_index(q, kv, min_chain=min_chain, max_depth=deepest - 1)


@settings(max_examples=60, deadline=None)
@given(case=grid_case, data=st.data())
def test_chain_inverse_is_the_transpose_of_the_chain_index(case, data):
    """Every valid (query, slot) of the chain index appears once, in its key's row of the inverse."""
    q, kv = case_pair(case, data)
    index, valid = build_chain_index(q, kv, min_chain=data.draw(st.integers(0, 10), label="min_chain"))
    inverse, inverse_valid = invert_chain_index(index, valid, len(kv))
    C = index.shape[1]
    assert inverse.shape == inverse_valid.shape == (len(kv), C)
    forward = {(int(index.view(-1)[f]), f) for f in valid.view(-1).nonzero().flatten().tolist()}
    rows, slots = inverse_valid.nonzero(as_tuple=True)
    backward = [(int(r), int(inverse[r, s])) for r, s in zip(rows.tolist(), slots.tolist())]
    assert len(backward) == len(set(backward)) and set(backward) == forward
    inverse2, inverse_valid2 = invert_chain_index(index, valid, len(kv), sync_check=False)
    assert torch.equal(inverse2, inverse) and torch.equal(inverse_valid2, inverse_valid)


def test_chain_gather_backward_without_atomics_equals_index_add():
    """The inverse-gather backward equals autograd's index_add backward wherever invalid slots carry
    no gradient (the chain part: masked scores), in float64; through chain_attention too."""
    g, x = make_grid([30, 17], 2, 0.9, 6, 0.8, 0.3, None, 3)
    m = GridMeta.of(pad_grid(g, 16))
    index, valid = build_chain_index(m)
    inverse, inverse_valid = invert_chain_index(index, valid, len(m))
    rows = torch.randn(len(m), 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*index.shape, 5, dtype=torch.float64) * valid[..., None]
    a, = torch.autograd.grad((chain_gather(rows, index, inverse, inverse_valid) * w).sum(), rows)
    b, = torch.autograd.grad((rows[index] * w).sum(), rows)
    torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)
    q, k, v = _qkv(len(m), len(m), 7, nkv=2)
    W = torch.randn(1, 4, len(m), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((chain_attention(q, k, v, index, valid, inverse=inverse, inverse_valid=inverse_valid)[0]
                               * W).sum(), (q, k, v))
    ref = torch.autograd.grad((chain_attention(q, k, v, index, valid)[0] * W).sum(), (q, k, v))
    for x1, x2 in zip(got, ref):
        torch.testing.assert_close(x1, x2, atol=1e-13, rtol=1e-13)
    with pytest.raises(ValueError, match="more than C=1"):
        invert_chain_index(torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1, dtype=torch.bool), 4)
    with pytest.raises(RuntimeError, match="more than C=1"):  # the device-side check (at once on CPU)
        invert_chain_index(torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1, dtype=torch.bool), 4,
                           sync_check=False)


def test_chain_index_worked_example_and_errors():
    # the docstring example of attention.py: [(0,0) (1,0) (2,0) (1,1) (1,2)]
    m = GridMeta(torch.tensor([0, 1, 2, 1, 1]), torch.tensor([0, 0, 0, 1, 2]), torch.zeros(5, dtype=torch.int64))
    index, valid = build_chain_index(m)
    assert valid.tolist() == [[False, False]] * 3 + [[True, False], [True, True]]
    assert index.tolist() == [[0, 0]] * 3 + [[3, 0], [3, 4]]
    assert build_chain_index(m, min_chain=4)[0].shape == (5, 4)
    # keys in another order, queries over them
    perm = torch.tensor([4, 2, 0, 3, 1])
    kv = sub_meta(m, perm)
    index, valid = build_chain_index(m, kv)
    assert index[4].tolist() == [3, 0] and valid[4].all()  # (1,1) is key 3, (1,2) key 0 of kv
    with pytest.raises(ValueError, match="twice"):
        build_chain_index(m, cat_meta(m, sub_meta(m, torch.tensor([3]))))
    with pytest.raises(RuntimeError, match="twice"):
        build_chain_index(m, cat_meta(m, sub_meta(m, torch.tensor([3]))), max_depth=2)
    deep = GridMeta(torch.tensor([0, 0]), torch.tensor([0, 2**20]), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="depths must be < 2\\*\\*20"):
        build_chain_index(deep)
    with pytest.raises(RuntimeError, match="depths must be < 2\\*\\*20"):
        build_chain_index(deep, max_depth=2**20)
    with pytest.raises(ValueError, match="no keys"):
        build_chain_index(m, sub_meta(m, torch.tensor([], dtype=torch.int64)))
    # a duplicate padding element or a duplicate depth-0 key is harmless
    pads = sub_meta(m, torch.tensor([], dtype=torch.int64)).padded(2)
    assert build_chain_index(m, cat_meta(m, sub_meta(m, torch.tensor([0])), pads))[1].sum() == 3
    with pytest.raises(ValueError):
        block_structure(m, m, 8, part="chain")
    with pytest.raises(ValueError):
        dense_mask(m, part="other")


# ----------------------------------------------------------------------------- float64 exactness


def _qkv(Eq, Ek, seed, dtype=torch.float64, nh=4, nkv=2, hd=8):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, nh, Eq, hd, generator=g, dtype=dtype) * 2).requires_grad_()
    k = (torch.randn(1, nkv, Ek, hd, generator=g, dtype=dtype) * 2).requires_grad_()
    v = torch.randn(1, nkv, Ek, hd, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


@settings(max_examples=50, deadline=None)
@given(case=grid_case, data=st.data())
def test_split_equals_sdpa_float64_forward_and_grads(case, data):
    qm, km = case_pair(case, data)
    nkv = data.draw(st.sampled_from([1, 2, 4]), label="nkv")
    q, k, v = _qkv(len(qm), len(km), case["seed"] % 1000, nkv=nkv)
    W = torch.randn(1, 4, len(qm), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    split = build_split_masks(qm, km, block_size=case["block_size"])
    out = split_attention(q, k, v, split, prefix_attention=dense_prefix_attention)
    grads = torch.autograd.grad((out * W).sum(), (q, k, v))

    mask = dense_mask(qm, km)
    rows = mask.any(1)  # SDPA gives NaN on rows without a key: compare those to 0 instead
    ref = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask[rows][None, None], enable_gqa=True)
    ref_grads = torch.autograd.grad((ref * W[:, :, rows]).sum(), (q, k, v))
    assert torch.isfinite(out).all() and (out[:, :, ~rows] == 0).all()
    torch.testing.assert_close(out[:, :, rows], ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert (grads[0][:, :, ~rows] == 0).all()


def test_split_objective_float64_matches_sdpa(tiny_drafter, objective_problem, monkeypatch):
    """The whole P-EAGLE objective, bucket-padded (padding rows), split attention with the prefix part
    computed densely: loss and every parameter gradient equal the dense-SDPA objective's (1e-12)."""
    check_split_objective_matches_sdpa(tiny_drafter, objective_problem, monkeypatch, num_layers=3,
                                       chain_kernel="auto")


def check_split_objective_matches_sdpa(tiny_drafter, objective_problem, monkeypatch, num_layers: int,
                                       chain_kernel: str):
    """float64 P-EAGLE objective on a bucket-padded three-document grid: split attention (prefix part
    dense, chain part by ``chain_kernel``) vs dense SDPA, :func:`assert_same_loss_and_grads`."""
    monkeypatch.setattr(attention_mod, "_flex_with_lse", dense_prefix_attention)
    P = objective_problem([23, 17, 9], 3, 0.8, 6, 5, 2, dtype=torch.float64)
    g, aux, last, head, argmax, norm, K = (P[k] for k in ("grid", "aux", "last", "head", "argmax", "norm", "K"))
    d = tiny_drafter(K=K, num_layers=num_layers, draft_vocab_size=60, seed=5).double()
    params = [p for p in d.parameters() if p.requires_grad]
    res = []
    for kind, pad, chain in (("sdpa", 1, "auto"), ("flex", 64, chain_kernel)):
        obj = PEagleObjective(d, head, chunk_size=16, attention=kind, pad_multiple=pad, chain_kernel=chain)
        loss, pred = obj(g, aux, last, argmax, norm)
        res.append((loss.detach(), pred, torch.autograd.grad(loss, params, allow_unused=True)))
    assert len(pad_grid(g, 64)) > len(g)  # padding rows were present
    assert_same_loss_and_grads(*res)


def assert_same_loss_and_grads(ref, got):
    """``(loss, pred, grads)`` of two objectives: loss to 1e-12 relative, the same predictions, every
    parameter gradient finite and equal (1e-12 absolute / 1e-10 relative; None on both sides or neither)."""
    (l0, p0, g0), (l1, p1, g1) = ref, got
    assert abs(l0.item() - l1.item()) < 1e-12 * abs(l0.item()) and torch.equal(p0, p1)
    for a, c in zip(g0, g1):
        if a is None:
            assert c is None
            continue
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c, a, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- merge / chain parts alone


def test_merge_by_lse_is_the_softmax_of_the_union():
    torch.manual_seed(0)
    Eq, Ek, hd = 6, 10, 4
    q, k, v = (torch.randn(1, 2, n, hd, dtype=torch.float64) for n in (Eq, Ek, Ek))
    a = torch.rand(Eq, Ek) < 0.4
    b = (torch.rand(Eq, Ek) < 0.4) & ~a
    a[0], b[0] = False, False  # no key at all
    a[1] = False  # chain only
    b[2] = False  # prefix only
    out_a, lse_a = dense_attention_with_lse(q, k, v, a)
    out_b, lse_b = dense_attention_with_lse(q, k, v, b)
    out, lse = merge_by_lse(out_a, lse_a, out_b, lse_b)
    ref, ref_lse = dense_attention_with_lse(q, k, v, a | b)
    torch.testing.assert_close(out, ref, atol=1e-14, rtol=1e-14)
    torch.testing.assert_close(lse, ref_lse, atol=1e-14, rtol=1e-14)
    assert (out[:, :, 0] == 0).all() and torch.isinf(lse[:, :, 0]).all()
    # gradients: finite, and zero into both lse of the row without keys
    la, lb, oa, ob = (t.detach().clone().requires_grad_() for t in (lse_a, lse_b, out_a, out_b))
    o, lo = merge_by_lse(oa, la, ob, lb)
    (o.sum() + torch.where(torch.isfinite(lo), lo, 0).sum()).backward()
    for t in (la, lb, oa, ob):
        assert torch.isfinite(t.grad).all()
    assert (la.grad[:, :, 0] == 0).all() and (lb.grad[:, :, 0] == 0).all()
    # half inputs: lse math in float32, output in the input dtype; float64 stays float64
    o16, l16 = merge_by_lse(out_a.bfloat16(), lse_a.float(), out_b.bfloat16(), lse_b.float())
    assert o16.dtype == torch.bfloat16 and l16.dtype == torch.float32
    torch.testing.assert_close(o16.double(), ref, atol=2e-2, rtol=2e-2)
    assert out.dtype == lse.dtype == torch.float64


def test_chain_attention_gqa_and_dtypes():
    m = GridMeta(torch.tensor([0, 1, 2, 1, 1, 0]), torch.tensor([0, 0, 0, 1, 2, 0]), torch.tensor([0, 0, 0, 0, 0, -1]))
    index, valid = build_chain_index(m)
    for nh, nkv in ((4, 4), (4, 2), (6, 1)):
        q, k, v = (t.detach() for t in _qkv(6, 6, nh + nkv, nh=nh, nkv=nkv))
        out, lse = chain_attention(q, k, v, index, valid)
        ref, ref_lse = dense_attention_with_lse(q, k, v, dense_mask(m, part="chain"))
        torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(lse, ref_lse, atol=1e-13, rtol=1e-13)
        ob, lb = chain_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), index, valid)
        assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float32 and ob.shape == (1, nh, 6, 8)
        torch.testing.assert_close(ob.double(), ref, atol=5e-2, rtol=5e-2)


@needs_cc
def test_compiled_chain_attention_equals_eager_float64():
    """Under torch.compile the chain part runs as fused products-and-sums (no tiny bmm); Inductor's CPU
    build of it equals the eager batched-matmul path in float64, output, lse and q/k/v gradients
    through the inverse-gather backward, GQA and a padding row (no valid slot) included."""
    torch._dynamo.reset()
    g, x = make_grid([30, 17], 2, 0.9, 6, 0.8, 0.3, None, 3)
    m = GridMeta.of(pad_grid(g, 16))
    index, valid = build_chain_index(m)
    inverse, inverse_valid = invert_chain_index(index, valid, len(m))
    assert (~valid.any(1)).any()  # rows without a chain key are part of the check
    W = torch.randn(1, 4, len(m), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def run(fn):
        q, k, v = _qkv(len(m), len(m), 11, nkv=2)
        out, lse = fn(q, k, v, index, valid, inverse=inverse, inverse_valid=inverse_valid)
        obj = (out * W).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
        return (out, lse, *torch.autograd.grad(obj, (q, k, v)))

    eager = run(chain_attention)
    compiled = run(torch.compile(chain_attention, fullgraph=True, dynamic=False))
    for a, b in zip(compiled, eager):
        assert torch.isfinite(a[torch.isfinite(b)]).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- real (eager, CPU) FlexAttention


def test_flex_lse_is_natural_log():
    """The prefix part through the real flex call: out and lse equal the dense prefix reference."""
    g, x = make_grid([40, 25], 3, 0.9, 4, 0.8, 0.2, None, 1)
    m = GridMeta.of(pad_grid(g, 32))
    bm = build_block_mask(m, m, 32, part="prefix")
    q, k, v = (t.detach().float() for t in _qkv(len(m), len(m), 3))
    out, lse = attention_mod._flex(q, k, v, bm, return_lse=True)
    ref, ref_lse = dense_attention_with_lse(q, k, v, dense_mask(m, part="prefix"))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[:, :, m.doc < 0]).all()


def test_flex_lse_through_the_older_api(monkeypatch):
    """torch without ``AuxRequest``: the deprecated ``return_lse=True`` gives the same lse."""
    m = GridMeta(torch.arange(40) % 20, torch.zeros(40, dtype=torch.int64), torch.arange(40) // 20)
    bm = build_block_mask(m, m, 16, part="prefix")
    q, k, v = (t.detach().float() for t in _qkv(40, 40, 4))
    new = attention_mod._flex(q, k, v, bm, return_lse=True)
    monkeypatch.setattr(attention_mod, "_AuxRequest", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = attention_mod._flex(q, k, v, bm, return_lse=True)
    torch.testing.assert_close(old[0], new[0])
    torch.testing.assert_close(old[1], new[1])


@settings(max_examples=25, deadline=None)
@given(case=grid_case, data=st.data())
def test_split_flex_equals_sdpa_and_joint(case, data):
    qm, km = case_pair(case, data, K=min(case["K"], 6), S_max=3)
    q, k, v = (t.detach().float() for t in _qkv(len(qm), len(km), case["seed"] % 1000))
    split = attend(q, k, v, make_attn_spec(qm, km, kind="flex"))
    joint = attend(q, k, v, make_attn_spec(qm, km, kind="flex_joint"))
    mask = dense_mask(qm, km)
    rows = mask.any(1)
    ref = manual_attention(q[:, :, rows], k, v, mask[rows])
    torch.testing.assert_close(split[:, :, rows], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, joint, atol=1e-5, rtol=1e-5)
    assert (split[:, :, ~rows] == 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_flex_through_drafter(tiny_drafter, seed):
    """Whole Drafter forward (fusion layer + plain layers + RoPE + GQA): split flex == sdpa == joint, fp32."""
    K = 6
    g, x = make_grid([70, 9, 45], 6, 0.8, K, 0.8, 0.2, None, seed)
    drafter = tiny_drafter(num_layers=3, K=K, seed=seed).eval()
    torch.manual_seed(seed)
    aux = torch.randn(x.numel(), 96)
    m = GridMeta.of(g)
    with torch.no_grad():
        hidden = drafter.grid_hidden(aux, g.hidden_index)
        outs = {kind: drafter(g.token_ids, hidden, g.position_ids, make_attn_spec(m, kind=kind, min_chain=K - 1))
                for kind in ("flex", "flex_joint", "sdpa")}
    for kind in ("flex_joint", "sdpa"):
        torch.testing.assert_close(outs["flex"][0], outs[kind][0], atol=1e-5, rtol=1e-5)
        for (kf, vf), (ks, vs) in zip(outs["flex"][1], outs[kind][1]):
            torch.testing.assert_close(kf, ks, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(vf, vs, atol=1e-5, rtol=1e-5)
    # the mask matters: plain causal attention over the depth-major grid gives other outputs
    E = len(g)
    with torch.no_grad():
        h_causal, _ = drafter(g.token_ids, hidden, g.position_ids,
                              AttnSpec(dense=torch.ones(E, E, dtype=torch.bool).tril()))
    assert (h_causal - outs["sdpa"][0]).abs().max() > 1e-3


def test_attn_spec_kinds_and_validation():
    m = GridMeta(torch.arange(4), torch.tensor([0, 0, 1, 2]), torch.zeros(4, dtype=torch.int64))
    s = make_attn_spec(m, kind="flex", min_chain=3)
    assert isinstance(s.split, SplitMasks) and s.block_mask is None and s.dense is None
    assert s.split.chain_index.shape == (4, 3)
    assert make_attn_spec(m, kind="flex_joint").block_mask is not None
    with pytest.raises(ValueError, match="exactly one"):
        AttnSpec(dense=torch.ones(4, 4, dtype=torch.bool), split=s.split)
    with pytest.raises(ValueError, match="exactly one"):
        AttnSpec()
    with pytest.raises(ValueError):
        make_attn_spec(m, kind="split")


# ----------------------------------------------------------------------------- compile and scale


def _split_layer_case(tiny_drafter, K: int = 4):
    """``(K, padded grid, the second layer of a 2-layer tiny drafter, (h, emb, cos, sin))``: one split layer's
    inputs over two documents (seeded)."""
    g, _ = make_grid([30, 20], 2, 0.9, K, 0.8, 0.3, None, 3)
    g = pad_grid(g, 32)
    d = tiny_drafter(num_layers=2, K=K, seed=1).eval()
    torch.manual_seed(0)
    h = torch.randn(len(g), 32)
    cos, sin = d.rotary_emb(h, g.position_ids[None])
    return K, g, d.layers[1], (h, d.embed_tokens(g.token_ids), cos, sin)


@pytest.mark.parametrize("opts", [None, {"fwd_BLOCK_N": 128, "fwd_BLOCK_M": 64}])
def test_split_layer_traces_fullgraph(tiny_drafter, flex_kernel_options_seen, opts):
    """A decoder layer with the split spec compiles with ``fullgraph=True`` (no graph break: no host
    sync, no data-dependent Python branch; Dynamo only, as CPU Inductor has no flex lse) and matches eager.
    With ``prefix_kernel_options`` (``train.prefix_kernel_options``) too: they sit on the split masks as sorted
    pairs (a constant for the compiled layer) and reach FlexAttention's call as a dict; eager (CPU)
    FlexAttention ignores them, so the output is the default's exactly."""
    torch._dynamo.reset()
    K, g, layer, (h, emb, cos, sin) = _split_layer_case(tiny_drafter)
    spec = make_attn_spec(GridMeta.of(g), kind="flex", min_chain=K - 1, prefix_kernel_options=opts)
    assert spec.split.prefix_kernel_options == (None if opts is None else (("fwd_BLOCK_M", 64), ("fwd_BLOCK_N", 128)))
    with torch.no_grad():
        eager, _ = layer(h, emb, cos, sin, spec)
        assert flex_kernel_options_seen == [opts]
        compiled, _ = torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)(h, emb, cos, sin, spec)
        default, _ = layer(h, emb, cos, sin, make_attn_spec(GridMeta.of(g), kind="flex", min_chain=K - 1))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, default, atol=0, rtol=0)


def test_prefix_compiled_apart_breaks_the_layer_graph_at_the_prefix_and_matches(tiny_drafter,
                                                                                flex_kernel_options_seen):
    """``train.prefix_compiled_apart``: inside a compiled layer the prefix FlexAttention runs behind a graph break
    (``_flex_compiled_apart``, its own compile on CUDA) instead of in the layer's graph: Dynamo reports a break where
    the default split layer has none, ``fullgraph=True`` refuses the layer, and the output is eager's (Dynamo only, as
    CPU Inductor has no flex lse). The kernel options still reach the call made apart, and outside a compiled
    layer the setting changes nothing."""
    torch._dynamo.reset()
    K, g, layer, (h, emb, cos, sin) = _split_layer_case(tiny_drafter)
    opts = {"fwd_BLOCK_M": 64}
    apart = make_attn_spec(GridMeta.of(g), kind="flex", min_chain=K - 1, prefix_kernel_options=opts,
                           prefix_compiled_apart=True)
    inline = make_attn_spec(GridMeta.of(g), kind="flex", min_chain=K - 1, prefix_kernel_options=opts)
    assert apart.split.prefix_compiled_apart and not inline.split.prefix_compiled_apart
    with torch.no_grad():
        eager, _ = layer(h, emb, cos, sin, inline)
        eager_apart, _ = layer(h, emb, cos, sin, apart)
        torch.testing.assert_close(eager_apart, eager, atol=0, rtol=0)
        assert torch._dynamo.explain(layer)(h, emb, cos, sin, inline).graph_break_count == 0
        torch._dynamo.reset()
        assert torch._dynamo.explain(layer)(h, emb, cos, sin, apart).graph_break_count >= 1
        torch._dynamo.reset()
        flex_kernel_options_seen.clear()
        compiled, _ = torch.compile(layer, backend="eager", dynamic=False)(h, emb, cos, sin, apart)
        assert flex_kernel_options_seen == [opts]  # the call made apart, with the options
        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)disable|skip"):
            torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)(h, emb, cos, sin, apart)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_prefix_compiled_apart_gradients_through_the_graph_break_float64(tiny_drafter, monkeypatch, ckpt):
    """The backward crosses the graph break: a layer compiled (AOT autograd, ``backend="aot_eager"``) with the prefix
    part apart gives eager's output and gradients (the hidden input and every parameter) in float64 to 1e-12, also under
    non-reentrant activation checkpointing around the compiled layer as the trainer wraps it. The prefix part is the
    dense stand-in (``_flex_with_lse`` swapped: eager FlexAttention has no CPU backward), which ``_flex_compiled_apart``
    looks up at call time, so it runs behind the break."""
    monkeypatch.setattr(attention_mod, "_flex_with_lse", dense_prefix_attention)
    torch._dynamo.reset()
    K, g, layer, inputs = _split_layer_case(tiny_drafter)
    layer = layer.double().train()
    spec = make_attn_spec(GridMeta.of(g), kind="flex", min_chain=K - 1, prefix_compiled_apart=True)
    compiled = torch.compile(layer, backend="aot_eager", dynamic=False)
    results = []
    for fn in (layer, compiled):
        args = [x.detach().double().requires_grad_(i == 0) for i, x in enumerate(inputs)]
        if ckpt:
            out, _ = torch.utils.checkpoint.checkpoint(fn, *args, spec, use_reentrant=False)
        else:
            out, _ = fn(*args, spec)
        wanted = [args[0], *layer.parameters()]
        results.append((out.detach(), torch.autograd.grad((out * out).sum(), wanted, allow_unused=True)))
    (o0, g0), (o1, g1) = results
    torch.testing.assert_close(o1, o0, atol=1e-12, rtol=1e-12)
    assert g0[0] is not None and sum(a is not None for a in g0) > 5  # the input and the layer's weights
    for a, b in zip(g0, g1):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)
    torch._dynamo.reset()


def test_prefix_kernel_options_for_resolves_auto_by_compute_capability():
    """``train.prefix_kernel_options: auto`` is the measured forward block on compute capability 9 (H100, H200)
    only; another GPU or no GPU (None) gets FlexAttention's own choice; a mapping passes through whatever the GPU,
    None stays None; any other string is refused."""
    from peagle_train.kernels.attention import HOPPER_PREFIX_KERNEL_OPTIONS, prefix_kernel_options_for

    assert HOPPER_PREFIX_KERNEL_OPTIONS == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4,
                                            "fwd_num_stages": 3}
    hopper = prefix_kernel_options_for("auto", (9, 0))
    assert hopper == HOPPER_PREFIX_KERNEL_OPTIONS
    hopper["fwd_BLOCK_M"] = 1  # a copy: the constant stays as measured
    assert prefix_kernel_options_for("auto", (9, 0))["fwd_BLOCK_M"] == 64
    for capability in ((8, 0), (8, 9), (10, 0), (7, 5), None):
        assert prefix_kernel_options_for("auto", capability) is None, capability
    given = {"fwd_BLOCK_M": 32, "USE_TMA": False}
    for capability in ((9, 0), (8, 0), None):
        assert prefix_kernel_options_for(given, capability) == given
        assert prefix_kernel_options_for(None, capability) is None
        assert prefix_kernel_options_for({}, capability) is None
    for bad in ("fast", "AUTO", ""):
        with pytest.raises(ValueError, match="train.prefix_kernel_options"):
            prefix_kernel_options_for(bad, (9, 0))


def test_split_masks_hold_auto_resolved_for_the_grids_device(monkeypatch):
    """``make_attn_spec(prefix_kernel_options="auto")`` resolves for the device of the grid's tensors: a CPU grid
    gets None (as without options); where that device reports compute capability 9 the split masks hold the forward
    block as sorted pairs, never the string; a mapping is kept as given, None stays None."""
    from peagle_train.kernels.attention import HOPPER_PREFIX_KERNEL_OPTIONS, device_capability

    assert device_capability(torch.device("cpu")) is None
    g, _ = make_grid([30, 20], 2, 0.9, 4, 0.8, 0.3, None, 3)
    m = GridMeta.of(g)
    assert make_attn_spec(m, kind="flex", prefix_kernel_options="auto").split.prefix_kernel_options is None
    seen = []

    def hopper(device):
        seen.append(device)
        return (9, 0)

    monkeypatch.setattr(attention_mod, "device_capability", hopper)
    split = make_attn_spec(m, kind="flex", prefix_kernel_options="auto").split
    assert seen == [g.anchor.device]
    assert split.prefix_kernel_options == tuple(sorted(HOPPER_PREFIX_KERNEL_OPTIONS.items()))
    assert split.prefix_kernel_options_auto is True
    given = make_attn_spec(m, kind="flex", prefix_kernel_options={"fwd_BLOCK_M": 32}).split
    assert given.prefix_kernel_options == (("fwd_BLOCK_M", 32),) and given.prefix_kernel_options_auto is False
    assert make_attn_spec(m, kind="flex", prefix_kernel_options=None).split.prefix_kernel_options is None
    with pytest.raises(ValueError, match="train.prefix_kernel_options"):
        make_attn_spec(m, kind="flex", prefix_kernel_options="fast")


@pytest.mark.parametrize("head_dim,dtype,value,applied", [
    (64, torch.bfloat16, "auto", True), (64, torch.float16, "auto", True),
    (64, torch.float32, "auto", False), (128, torch.bfloat16, "auto", False),
    (128, torch.float32, {"fwd_BLOCK_M": 32}, True)])
def test_auto_block_applies_only_at_the_head_dim_and_dtype_it_was_measured(monkeypatch, head_dim, dtype, value,
                                                                            applied):
    """``auto``'s block reaches the prefix FlexAttention call only for head dimension 64 in bf16 / fp16 (where it was
    measured, ``AUTO_BLOCK_SCOPE``); elsewhere that layer runs with FlexAttention's own choice. Options the recipe
    gives as a mapping apply at any head dimension and dtype."""
    from peagle_train.kernels.attention import HOPPER_PREFIX_KERNEL_OPTIONS, auto_block_fits, split_attention

    monkeypatch.setattr(attention_mod, "device_capability", lambda device: (9, 0))
    g, _ = make_grid([30, 20], 2, 0.9, 4, 0.8, 0.3, None, 3)
    split = make_attn_spec(GridMeta.of(g), kind="flex", prefix_kernel_options=value).split
    calls = []

    def recorder(q, k, v, mask, kernel_options=None):
        calls.append(kernel_options)
        return torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32)

    monkeypatch.setattr(attention_mod, "_flex_with_lse", recorder)
    E = len(g)
    q = torch.randn(1, 4, E, head_dim).to(dtype)
    k, v = torch.randn(1, 2, E, head_dim).to(dtype), torch.randn(1, 2, E, head_dim).to(dtype)
    split_attention(q, k, v, split)
    expected = (HOPPER_PREFIX_KERNEL_OPTIONS if value == "auto" else value) if applied else None
    assert calls == [expected]
    assert auto_block_fits(head_dim, dtype) is (head_dim == 64 and dtype != torch.float32)


def test_split_build_no_dense_materialisation_at_scale():
    """8192 × 8 grid (E ≈ 65k): split spec (prefix BlockMask + chain index) in a fresh process, peak RSS
    far below E² bytes, a few seconds; and the prefix mask computes far fewer blocks than the joint one."""
    code = textwrap.dedent("""
        import resource, time, torch
        from peagle_train.kernels.attention import build_split_masks
        from peagle_train.peagle.masks import GridMeta, block_structure
        from peagle_train.peagle.grid import build_grid, cod_sample
        N, K = 8192, 8
        lm = torch.ones(N, dtype=torch.bool)
        doc = torch.zeros(N, dtype=torch.int64); doc[5000:] = 1
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kept = cod_sample(lm, doc, K, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
        g = build_grid(torch.zeros(N, dtype=torch.int64), lm, doc, kept, 5)
        m = GridMeta.of(g)
        t = time.perf_counter()
        split = build_split_masks(m, min_chain=K - 1)
        dt = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        E = len(m)
        pad = -(-E // 128) * 128
        pp, pf = block_structure(m.padded(pad), m.padded(pad), 128, part="prefix")
        jp, jf = block_structure(m.padded(pad), m.padded(pad), 128)
        print(E, dt, (peak - base) * 1024, int(pp.sum()), int(jp.sum()), int(split.chain_valid.sum()),
              int((m.depth * (m.depth >= 1)).sum()), split.chain_index.shape[1])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    E, dt, grown, prefix_partial, joint_partial, n_chain, want_chain, C = out.stdout.split()
    E, dt, grown = int(E), float(dt), int(grown)
    assert E > 65000
    assert dt < 10.0, f"split build took {dt:.1f}s"
    assert grown < E * E / 16, f"RSS grew by {grown / 2**20:.0f} MiB (E² = {E * E / 2**30:.1f} GiB)"
    assert int(prefix_partial) < int(joint_partial) / 4  # the point of the split: few partial blocks
    # a query at depth d sees its d - 1 shallower chain elements and itself
    assert int(n_chain) == int(want_chain) and int(C) == 7
