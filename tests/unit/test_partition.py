"""Pins sequence partitioning = exact within-sequence gradient accumulation (PEAGLE_SPEC §3, ``partition.py``).

* Boundaries ``B_s = floor(s*N/S)``, owner rules (depth 0/1 by ``a + d``, depth ≥ 2
  inherits its depth-1 element), the docstring's worked example.
* Plan invariants on random packed grids: every supervised element is owned by
  exactly one segment; segment ``s`` holds exactly its owned elements plus every
  depth-0 element with anchor ``< B_{s+1}``; every key an owned element attends to in
  the full grid is present in its segment; indices keep the depth-major order.
* The real thing, in float64 with the dense ``sdpa`` path (flex has no CPU
  backward): for S ∈ {1, 2, 3, 4, 7}, KL and CE loss, a packed multi-document
  input with padding and COD sampling, the sum over segments of the segment
  gradients equals the unpartitioned gradient for EVERY drafter parameter
  (max abs diff < 1e-10), the segment losses sum to the unpartitioned loss, and
  each segment's predictions on owned elements equal the full grid's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle_train.methods.peagle import PEagleObjective
from peagle_train.peagle.grid import build_grid, cod_sample, supervised_count
from peagle_train.peagle.masks import GridMeta, dense_mask
from peagle_train.peagle.partition import owner_segment, plan_partitions, segment_boundaries

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _grid(packed, K=4, r=0.7, r_min=0.2, seed=0, max_anchors=None):
    b = packed
    kept = cod_sample(b["loss_mask"], b["doc_ids"], K, r, r_min, max_anchors,
                      generator=torch.Generator().manual_seed(seed))
    return build_grid(b["input_ids"], b["loss_mask"], b["doc_ids"], kept, mask_token_id=127)


# ----------------------------------------------------------------------------- the plan


def test_boundaries():
    assert segment_boundaries(8, 2).tolist() == [0, 4, 8]
    assert segment_boundaries(10, 3).tolist() == [0, 3, 6, 10]
    assert segment_boundaries(7, 7).tolist() == list(range(8))
    assert segment_boundaries(5, 1).tolist() == [0, 5]
    for bad in (0, 9):
        with pytest.raises(ValueError):
            segment_boundaries(8, bad)


def test_docstring_worked_example():
    """N = 8, S = 2: (5,0) -> seg 1; (2,1) (position 3) -> seg 0; (3,2) follows (3,1) (position 4) -> seg 1."""
    x = torch.arange(8)
    loss_mask = torch.ones(8, dtype=torch.bool)
    doc_ids = torch.zeros(8, dtype=torch.int64)
    kept = cod_sample(loss_mask, doc_ids, K=3, r=1.0, r_min=1.0)
    g = build_grid(x, loss_mask, doc_ids, kept, mask_token_id=99)
    owner = owner_segment(g, 8, 2)
    own = {(int(a), int(d)): int(s) for a, d, s in zip(g.anchor, g.depth, owner)}
    assert own[(5, 0)] == 1 and own[(3, 0)] == 0 and own[(4, 0)] == 1
    assert own[(2, 1)] == 0 and own[(3, 1)] == 1
    assert own[(2, 2)] == 0  # position 4 but its depth-1 element (2,1) is at position 3
    assert own[(3, 2)] == 1
    segs = plan_partitions(g, 8, 2)
    seg1 = g.select(segs[1].index)
    ctx = [(int(a), int(d)) for a, d, o in zip(seg1.anchor, seg1.depth, segs[1].owned) if not o]
    assert ctx == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert set(own) == {(int(a), int(d)) for seg in segs for a, d, o in
                        zip(g.anchor[seg.index], g.depth[seg.index], seg.owned) if o}


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(2, 40), min_size=1, max_size=4),
    n_pad=st.integers(0, 8),
    K=st.integers(1, 8),
    r=st.floats(0.4, 1.0),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_plan_invariants(packed_batch, lens, n_pad, K, r, seed, data):
    b = packed_batch(lens, n_pad, loss_prob=0.8, seed=seed)
    N = b["N"]
    S = data.draw(st.integers(1, N), label="S")
    g = _grid(b, K=K, r=r, r_min=0.1, seed=seed)
    segs = plan_partitions(g, N, S)
    assert len(segs) == S
    B = segment_boundaries(N, S).tolist()
    owner = owner_segment(g, N, S)
    full_mask = dense_mask(GridMeta.of(g))
    owned_count = torch.zeros(len(g), dtype=torch.int64)
    key_of = {(int(a), int(d)): i for i, (a, d) in enumerate(zip(g.anchor, g.depth))}
    for s, seg in enumerate(segs):
        idx = seg.index
        assert idx.dtype == torch.int64 and seg.owned.dtype == torch.bool and idx.shape == seg.owned.shape
        assert (idx[1:] > idx[:-1]).all()  # increasing => depth-major order kept
        owned_count[idx[seg.owned]] += 1
        a, d = g.anchor[idx], g.depth[idx]
        # owned rule
        p = torch.where(d == 0, a, a + 1)
        assert ((p[seg.owned] >= B[s]) & (p[seg.owned] < B[s + 1])).all()
        # context = exactly the depth-0 elements with anchor < B_s (and all of them)
        ctx = ~seg.owned
        assert (d[ctx] == 0).all() and (a[ctx] < B[s]).all()
        expect = set(((g.depth == 0) & (g.anchor < B[s + 1])).nonzero().flatten().tolist()) | set(
            (owner == s).nonzero().flatten().tolist())
        assert set(idx.tolist()) == expect
        # every key an owned element sees in the full grid is in the segment
        present = torch.zeros(len(g), dtype=torch.bool)
        present[idx] = True
        need = full_mask[idx[seg.owned]].any(0)
        assert not (need & ~present).any()
        # Segment.apply zeroes loss weight on context-only rows, keeps the rest
        sub = seg.apply(g)
        assert torch.equal(sub.loss_weight, g.loss_weight[idx] * seg.owned.float())
        assert torch.equal(sub.anchor, a)
    # each element owned exactly once (supervised ones in particular)
    assert (owned_count == 1).all()
    # depth >= 2 follows its depth-1 element
    for i in (g.depth >= 2).nonzero().flatten().tolist():
        j = key_of[(int(g.anchor[i]), 1)]
        assert owner[i] == owner[j]


# ----------------------------------------------------------------------------- exact gradients


@pytest.fixture(scope="module")
def problem(tiny_drafter, packed_batch):
    """Packed 3-document input with padding, COD sample, float64 drafter and targets."""
    torch.manual_seed(0)
    b = packed_batch([19, 7, 16], n_pad=4, loss_prob=0.75, seed=5)
    K = 4
    g = _grid(b, K=K, r=0.8, r_min=0.3, seed=1)
    drafter = tiny_drafter(num_layers=2, K=K, draft_vocab_size=100, seed=3).double()
    N, T, V = b["N"], 32, 128
    aux = torch.randn(N, 3 * T, dtype=torch.float64)
    last = torch.randn(N, T, dtype=torch.float64)
    full_head = torch.randn(V, T, dtype=torch.float64)
    draft_ids = drafter.d2t + torch.arange(drafter.d2t.numel())
    argmax = (last @ full_head.T).argmax(-1)
    assert (g.depth == K - 1).any() and (g.loss_weight == 0).any()
    return dict(b=b, g=g, drafter=drafter, aux=aux, last=last, head=full_head[draft_ids], argmax=argmax, N=N)


def _grads(obj):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in obj.drafter.named_parameters()}


@pytest.mark.parametrize("loss", ["kl", "ce"])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 7])
def test_partitioned_gradients_equal_unpartitioned(problem, loss, S):
    P = problem
    g, N = P["g"], P["N"]
    obj = PEagleObjective(P["drafter"], P["head"], loss=loss, chunk_size=13, attention="sdpa")
    norm = float(supervised_count(g))

    obj.zero_grad(set_to_none=True)
    full_loss, full_pred = obj(g, P["aux"], P["last"], P["argmax"], norm)
    full_loss.backward()
    ref = _grads(obj)
    assert full_loss.dtype == torch.float64
    # the check must not be vacuous: every parameter gets a gradient, and a nonzero one
    for n, gr in ref.items():
        assert gr is not None, n
        assert gr.abs().max() > 0, n

    obj.zero_grad(set_to_none=True)
    seg_losses = []
    segs = plan_partitions(g, N, S)
    for seg in segs:
        loss_s, pred_s = obj(seg.apply(g), P["aux"], P["last"], P["argmax"], norm)
        loss_s.backward()  # accumulates into .grad
        seg_losses.append(loss_s.detach())
        # predictions of owned elements equal the full grid's
        assert torch.equal(pred_s[seg.owned], full_pred[seg.index[seg.owned]])
    part = _grads(obj)

    assert abs(float(sum(seg_losses)) - float(full_loss)) < 1e-12
    for n in ref:
        assert part[n] is not None, n
        diff = (part[n] - ref[n]).abs().max().item()
        assert diff < 1e-10, f"{n}: max abs diff {diff:.3e} (S={S}, loss={loss})"


def test_partitioned_gradients_with_bucketed_padding(problem):
    """Segments padded to a bucket (``pad_multiple``) still sum to the unpartitioned gradient."""
    P = problem
    g, N = P["g"], P["N"]
    norm = float(supervised_count(g))
    ref_obj = PEagleObjective(P["drafter"], P["head"], loss="kl", attention="sdpa")
    pad_obj = PEagleObjective(P["drafter"], P["head"], loss="kl", attention="sdpa", pad_multiple=32)
    ref_obj.zero_grad(set_to_none=True)
    ref_obj(g, P["aux"], P["last"], P["argmax"], norm)[0].backward()
    ref = _grads(ref_obj)
    ref_obj.zero_grad(set_to_none=True)
    for seg in plan_partitions(g, N, 3):
        pad_obj(seg.apply(g), P["aux"], P["last"], P["argmax"], norm)[0].backward()
    part = _grads(pad_obj)
    for n in ref:
        assert (part[n] - ref[n]).abs().max().item() < 1e-10, n


def test_owned_supervised_elements_cover_the_grid_once(problem):
    g, N = problem["g"], problem["N"]
    sup = g.loss_weight > 0
    for S in (1, 2, 3, 4, 7):
        count = torch.zeros(len(g), dtype=torch.int64)
        for seg in plan_partitions(g, N, S):
            count[seg.index[seg.owned]] += 1
        assert (count[sup] == 1).all()
        assert int(sum(((seg.apply(g).loss_weight > 0).sum()) for seg in plan_partitions(g, N, S))) == int(sup.sum())


def test_partitioned_gradients_equal_unpartitioned_with_depth_weights(problem):
    """``train.depth_weights`` scale each element's loss by its depth's weight and keep the normaliser, so
    segments still add up to the unpartitioned loss and gradient (float64, S = 3); the weighted loss is
    the manual Σ w[depth]·KL over the grid; ``eval()`` mode gives the unweighted loss."""
    P = problem
    g, N = P["g"], P["N"]
    norm = float(supervised_count(g))
    w = [1.0, 0.5, 2.0, 0.25]
    obj = PEagleObjective(P["drafter"], P["head"], loss="kl", chunk_size=13, attention="sdpa", depth_weights=w)
    plain = PEagleObjective(P["drafter"], P["head"], loss="kl", chunk_size=13, attention="sdpa")
    obj.zero_grad(set_to_none=True)
    full, _ = obj(g, P["aux"], P["last"], P["argmax"], norm)
    full.backward()
    ref = _grads(obj)
    obj.zero_grad(set_to_none=True)
    seg_sum = 0.0
    for seg in plan_partitions(g, N, 3):
        loss_s, _ = obj(seg.apply(g), P["aux"], P["last"], P["argmax"], norm)
        loss_s.backward()
        seg_sum += float(loss_s.detach())
    part = _grads(obj)
    assert abs(seg_sum - float(full)) < 1e-12
    for n in ref:
        assert (part[n] - ref[n]).abs().max().item() < 1e-10, n
    with torch.no_grad():  # per-depth losses of the unweighted objective, one depth's weight at a time
        by_depth = []
        for d in range(4):
            one = PEagleObjective(P["drafter"], P["head"], loss="kl", chunk_size=13, attention="sdpa",
                                  depth_weights=[float(j == d) for j in range(4)])
            by_depth.append(float(one(g, P["aux"], P["last"], P["argmax"], norm)[0]))
        unweighted = float(plain(g, P["aux"], P["last"], P["argmax"], norm)[0])
        assert all(x > 0 for x in by_depth)
        assert abs(sum(by_depth) - unweighted) < 1e-12 * unweighted
        assert abs(sum(wd * x for wd, x in zip(w, by_depth)) - float(full)) < 1e-12 * float(full)
        obj.eval()
        assert float(obj(g, P["aux"], P["last"], P["argmax"], norm)[0]) == unweighted
        obj.train()
    with pytest.raises(ValueError, match="K = 4"):
        PEagleObjective(P["drafter"], P["head"], attention="sdpa", depth_weights=[1.0, 1.0])
