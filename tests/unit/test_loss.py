"""Pins the chunked loss and per-depth metrics (PEAGLE_SPEC §3 "Loss and metrics", ``loss.py``).

* ``chunked_loss`` (KL and CE) equals a plain unchunked reference written from the
  spec — values AND gradients w.r.t. the drafter hidden states, the final norm and
  the head, in float64 — for several chunk sizes (1, odd, exact, larger than E), with
  and without autograd; the returned predictions are the drafter's argmax.
* KL is the forward ``KL(p_target || p_draft)`` over the draft vocab with the target
  restricted to the draft vocab and renormalised: zero when the drafter's
  distribution equals that restriction (even though the target's full-vocab
  distribution puts mass outside the draft vocab), positive otherwise.
* ``DepthStats``: accuracy, conditional accuracy and simulated acceptance length
  ``AL = 1 + a0 + a0*c1 + a0*c1*c2 + ...`` on a hand-built example, exclusion of
  out-of-draft-vocab targets and unsupervised rows, and add/stack round trips.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.model.drafter import RMSNorm
from peagle_train.peagle.metrics import DepthStats, depth_stats

pytestmark = pytest.mark.usefixtures("torch_single_thread")

T, H, V, Vd, N, E = 12, 10, 40, 17, 30, 23


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    last = torch.randn(N, T, generator=g, dtype=torch.float64)
    full_head = torch.randn(V, T, generator=g, dtype=torch.float64) * 2
    draft_ids = torch.randperm(V, generator=g)[:Vd].sort().values
    target = TargetDist(last, full_head[draft_ids], (last @ full_head.T).argmax(-1))
    norm = RMSNorm(H).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=g, dtype=torch.float64))
    head = nn.Linear(H, Vd, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(Vd, H, generator=g, dtype=torch.float64))
    h = torch.randn(E, H, generator=g, dtype=torch.float64, requires_grad=True)
    label_index = torch.randint(0, N, (E,), generator=g)
    weight = torch.rand(E, generator=g, dtype=torch.float64)
    weight[::5] = 0.0
    return target, norm, head, h, label_index, weight, full_head, draft_ids


def reference_loss(norm, head, h, label_index, weight, last, full_head, draft_ids, kind):
    """Spec §3, written out plainly: full-vocab target -> restrict to draft vocab -> renormalise."""
    logits_d = head(norm(h))  # [E, Vd]
    logp_d = F.log_softmax(logits_d, -1)
    t_full = last[label_index] @ full_head.T  # [E, V] full-vocab target logits
    p_restricted = F.softmax(t_full, -1)[:, draft_ids]
    p_restricted = p_restricted / p_restricted.sum(-1, keepdim=True)
    if kind == "kl":
        per = (p_restricted * (p_restricted.log() - logp_d)).sum(-1)
    else:
        greedy_in_draft = p_restricted.argmax(-1)
        per = -logp_d.gather(-1, greedy_in_draft[:, None])[:, 0]
    return (per * weight).sum(), logits_d.argmax(-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize("chunk", [1, 4, 7, E, 1000])
def test_chunked_equals_reference_values_and_grads(kind, chunk, fused):
    target, norm, head, h, li, w, full_head, draft_ids = _setup()
    params = [h, norm.weight, head.weight]

    ref, ref_pred = reference_loss(norm, head, h, li, w, target.last, full_head, draft_ids, kind)
    ref_grads = torch.autograd.grad(ref, params)

    got, pred = chunked_loss(norm, head, h, li, w, target, kind=kind, chunk_size=chunk, fused=fused)
    assert got.dtype == torch.float64
    got_grads = torch.autograd.grad(got, params)
    assert abs(got.item() - ref.item()) < 1e-10 * max(1.0, abs(ref.item()))
    assert torch.equal(pred, ref_pred) and pred.dtype == torch.int64
    for gr, rr in zip(got_grads, ref_grads):
        torch.testing.assert_close(gr, rr, atol=1e-10, rtol=1e-10)

    with torch.no_grad():
        nograd, pred2 = chunked_loss(norm, head, h, li, w, target, kind=kind, chunk_size=chunk, fused=fused)
    assert abs(nograd.item() - ref.item()) < 1e-10 * max(1.0, abs(ref.item()))
    assert torch.equal(pred2, ref_pred)


def test_chunked_loss_accumulates_in_float32_for_bf16():
    target, norm, head, h, li, w, *_ = _setup()
    t32 = TargetDist(target.last.float(), target.head.float(), target.argmax)
    hb = h.detach().to(torch.bfloat16)
    loss, _ = chunked_loss(norm.to(torch.bfloat16), head.to(torch.bfloat16), hb, li, w.float(), t32, chunk_size=5)
    assert loss.dtype == torch.float32
    ref, _ = reference_loss(norm.float(), head.float(), hb.float(), li, w.float(), t32.last,
                            torch.zeros(V, T).index_copy(0, torch.arange(Vd), t32.head), torch.arange(Vd), "kl")
    assert abs(loss.item() - ref.item()) < 0.05 * abs(ref.item())


def _dispatched(fn) -> list:
    """Run ``fn``; return ``(aten op, args, output)`` of every op it dispatched (a TorchDispatchMode probe)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ops.append((func, args, out))
            return out

    with Probe():
        fn()
    return ops


def test_target_logits_under_autocast_need_no_float32_head_copy():
    """Under bf16 autocast the target matmul is bf16 whatever its operands: draft_logits gives the same
    bits as upcasting first (what autocast would undo), without any float32 copy of the head; without
    autocast it runs in float32 as before."""
    g = torch.Generator().manual_seed(3)
    last, head = (torch.randn(n, 64, generator=g).bfloat16() for n in (50, 300))
    target, rows = TargetDist(last, head, torch.zeros(50, dtype=torch.long)), torch.arange(0, 50, 3)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        upcast_first = last[rows].float() @ head.float().T
        got = []
        ops = _dispatched(lambda: got.append(target.draft_logits(rows)))
    made = [(tuple(out.shape), out.dtype) for func, _, out in ops if func is torch.ops.aten._to_copy.default]
    got = got[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, upcast_first)
    assert ((300, 64), torch.float32) not in made and ((64, 300), torch.float32) not in made
    plain = target.draft_logits(rows)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, last[rows].float() @ head.float().T, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_fused_loss_keeps_no_logits_and_never_recomputes_the_head(kind, monkeypatch):
    """The fused path saves nothing of width Vd for the backward and never runs the lm_head module
    (the recompute path does both); scaling the loss scales every gradient (the backward multiplies
    by the incoming gradient); a frozen head gets no gradient."""
    target, norm, head, h, li, w, *_ = _setup()
    params = [h, norm.weight, head.weight]
    calls = []
    linear_forward = nn.Linear.forward

    def counted(self, x):
        if self is head:
            calls.append("lm_head")
        return linear_forward(self, x)

    monkeypatch.setattr(nn.Linear, "forward", counted)  # a hook on the head would (rightly) disable fusing
    grads = {}
    for fused in (True, False):
        saved, calls[:] = [], []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss, _ = chunked_loss(norm, head, h, li, w, target, kind=kind, chunk_size=7, fused=fused)
        grads[fused] = torch.autograd.grad(3.0 * loss, params)
        wide = [sh for sh in saved if sh and sh[-1] == Vd]
        if fused:
            assert not wide and not calls, (wide, calls)
        else:
            assert wide and calls  # the probe works: the recompute path keeps chunk logits
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    head.weight.requires_grad_(False)
    loss, _ = chunked_loss(norm, head, h, li, w, target, kind=kind, chunk_size=7)
    gh, gn = torch.autograd.grad(loss, [h, norm.weight])
    torch.testing.assert_close(gh, grads[True][0] / 3.0, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(gn, grads[True][1] / 3.0, atol=1e-12, rtol=1e-10)


def test_fused_loss_under_bf16_autocast_matches_recompute():
    """bf16 autocast on CPU, float32 master weights: both paths run the head matmul in bf16 (same
    logits, same greedy ids); loss and gradients agree with the float64 reference to bf16 rounding.
    (CPU autocast runs the recompute path's target log-softmax in bf16; the fused path takes it in
    float32, as CUDA autocast does for both.)"""
    target, norm, head, h, li, w, full_head, draft_ids = _setup()
    params64 = [h, norm.weight, head.weight]
    ref, _ = reference_loss(norm, head, h, li, w, target.last, full_head, draft_ids, "kl")
    ref_grads = torch.autograd.grad(ref, params64)
    norm, head = norm.float(), head.float()
    t32 = TargetDist(target.last.float(), target.head.float(), target.argmax)
    hb = h.detach().float().requires_grad_(True)
    out = {}
    for fused in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, pred = chunked_loss(norm, head, hb, li, w.float(), t32, chunk_size=5, fused=fused)
        out[fused] = (loss, pred, torch.autograd.grad(loss, [hb, norm.weight, head.weight]))
    assert torch.equal(out[True][1], out[False][1])
    for loss, _, grads in out.values():
        assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 2e-3 * abs(ref.item())
        for a, b in zip(grads, ref_grads):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), b, atol=2e-2 * float(b.abs().max()), rtol=0)


def _head_gemms(fn):
    """Run ``fn``; return ``(out shape, operand dtypes)`` of every matmul whose operands have H columns
    or rows (the drafter head's forward and gradient GEMMs; the target's have T)."""
    mm = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    seen = []
    for func, args, out in _dispatched(fn):
        ops = [a for a in args if isinstance(a, torch.Tensor)][-2:]
        if func in mm and any(H in a.shape for a in ops):
            seen.append((tuple(out.shape), tuple(a.dtype for a in ops)))
    return seen


def test_fused_loss_gemms_run_in_the_models_dtype_and_only_where_needed():
    """A bf16 model without autocast (DeepSpeed bf16): the fused head GEMMs run in bf16, as
    ``lm_head(norm(h))`` does, not on float32 copies. A frozen head costs no head-gradient GEMM and
    a frozen body (states and norm) no state-gradient GEMM; the gradients that remain are right."""
    target, norm, head, h, li, w, full_head, draft_ids = _setup()
    nb, hb = copy.deepcopy(norm).to(torch.bfloat16), copy.deepcopy(head).to(torch.bfloat16)  # .to is in place
    xb = h.detach().to(torch.bfloat16).requires_grad_(True)
    t32 = TargetDist(target.last.float(), target.head.float(), target.argmax)

    def run(fused):
        loss, _ = chunked_loss(nb, hb, xb, li, w.float(), t32, chunk_size=8, fused=fused)
        loss.backward()

    fused, recompute = _head_gemms(lambda: run(True)), _head_gemms(lambda: run(False))
    assert fused and {d for _, d in fused} == {(torch.bfloat16, torch.bfloat16)}, fused
    assert {d for _, d in recompute} == {(torch.bfloat16, torch.bfloat16)}, recompute

    ref, _ = reference_loss(norm, head, h, li, w, target.last, full_head, draft_ids, "kl")
    ref_h, ref_w = torch.autograd.grad(ref, [h, head.weight])
    head.weight.requires_grad_(False)
    gemms = _head_gemms(lambda: torch.autograd.grad(chunked_loss(norm, head, h, li, w, target, chunk_size=8)[0], h))
    assert (Vd, H) not in {o for o, _ in gemms} and gemms  # no [Vd, H] head-gradient GEMM
    head.weight.requires_grad_(True)
    h0 = h.detach()
    norm.weight.requires_grad_(False)
    gemms = _head_gemms(lambda: chunked_loss(norm, head, h0, li, w, target, chunk_size=8)[0].backward())
    assert (Vd, H) in {o for o, _ in gemms} and all(o[-1] != H or o == (Vd, H) for o, _ in gemms), gemms
    torch.testing.assert_close(head.weight.grad, ref_w, atol=1e-10, rtol=1e-10)


def test_fused_loss_falls_back_for_heads_it_cannot_read_as_a_weight(monkeypatch):
    """The fused path reads ``lm_head.weight``; a head whose module call means more than that (a bias,
    a subclass or a forward hook) or whose weight is a shard at loss time (ZeRO-3 ``ds_id``, an FSDP2
    ``DTensor``) takes the recompute path, through the module, and still gives the reference loss."""
    import peagle_train.kernels.loss as loss_mod

    target, norm, head, h, li, w, full_head, draft_ids = _setup()
    used = []
    fused_loss = loss_mod._fused_loss
    monkeypatch.setattr(loss_mod, "_fused_loss", lambda *a, **k: used.append("fused") or fused_loss(*a, **k))
    chunked_loss(norm, head, h, li, w, target, chunk_size=7)
    assert used == ["fused"] and loss_mod.loss_path(head, fused=True) == "fused"
    with torch.no_grad():
        chunked_loss(norm, head, h, li, w, target, chunk_size=7)
    assert used == ["fused"] and loss_mod.loss_path(head, fused=True, grads=False) == "no-grad"

    class Biased(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5

    biased = nn.Linear(H, Vd, bias=True).double()
    sub = Biased(H, Vd, bias=False).double()
    hooked = nn.Linear(H, Vd, bias=False).double()
    hooked.register_forward_hook(lambda m, i, o: o * 2.0)
    sharded = nn.Linear(H, Vd, bias=False).double()
    sharded.weight.ds_id = 7
    for other in (biased, sub, hooked, sharded):
        with torch.no_grad():
            other.weight.copy_(head.weight)
        used.clear()
        got, _ = chunked_loss(norm, other, h, li, w, target, chunk_size=7)
        ref, _ = reference_loss(norm, other, h, li, w, target.last, full_head, draft_ids, "kl")
        assert used == [] and abs(got.item() - ref.item()) < 1e-10 * abs(ref.item()), type(other)
        assert loss_mod.loss_path(other, fused=True) == "recompute"  # what the trainer's step record reports


def test_kl_zero_when_draft_equals_restricted_target():
    """Drafter logits = target logits on the draft vocab (+ any per-row shift) -> KL == 0."""
    target, _, _, _, li, w, full_head, draft_ids = _setup(1)
    # the full-vocab target puts real mass outside the draft vocab
    outside = 1 - F.softmax(target.last[li] @ full_head.T, -1)[:, draft_ids].sum(-1)
    assert outside.mean() > 0.1
    h = target.last[li].clone().requires_grad_(True)  # "drafter hidden" = target final hidden
    head = nn.Linear(T, Vd, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(target.head)
    loss, _ = chunked_loss(nn.Identity(), head, h, li, w, target, kind="kl", chunk_size=6)
    assert abs(loss.item()) < 1e-12
    (gh,) = torch.autograd.grad(loss, h)
    assert gh.abs().max() < 1e-12  # a minimum
    # a shifted head (different distribution) gives a strictly positive KL
    with torch.no_grad():
        head.weight.add_(0.5 * torch.randn_like(head.weight))
    loss2, _ = chunked_loss(nn.Identity(), head, h, li, w, target, kind="kl", chunk_size=6)
    assert loss2.item() > 1e-3


def test_zero_weight_rows_do_not_contribute_and_bad_kind_raises():
    target, norm, head, h, li, w, *_ = _setup(2)
    w0 = torch.zeros_like(w)
    loss, _ = chunked_loss(norm, head, h, li, w0, target, kind="kl", chunk_size=4)
    assert loss.item() == 0.0
    (gh,) = torch.autograd.grad(loss, h)
    assert gh.abs().max() == 0
    with pytest.raises(ValueError):
        chunked_loss(norm, head, h, li, w, target, kind="mse")


def test_chunked_loss_empty():
    target, norm, head, _, _, _, *_ = _setup()
    loss, pred = chunked_loss(norm, head, torch.zeros(0, H, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
                              torch.zeros(0, dtype=torch.float64), target)
    assert loss.item() == 0.0 and pred.numel() == 0


# ----------------------------------------------------------------------------- DepthStats


def test_depth_stats_hand_built():
    """Four chains, K = 3.

    chain  d0  d1  d2      (1 = correct, x = absent)
    a=0     1   1   0
    a=1     1   0   1
    a=2     0   1   x
    a=3     1   x   x
    acc:  d0 3/4, d1 2/3, d2 1/2.
    cond: d0 3/4; d1 given d0 ok: chains 0,1 -> 1/2; d2 given d0,d1 ok: chain 0 -> 0/1.
    AL(3) = 1 + 3/4 + 3/4*1/2 + 3/4*1/2*0 = 2.125.
    """
    anchor = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1])
    depth = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    correct = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    weight = torch.ones(9)
    in_vocab = torch.ones(9, dtype=torch.bool)
    st = depth_stats(anchor, depth, weight, correct, in_vocab, K=3)
    assert st.accuracy() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert st.conditional_accuracy() == pytest.approx([3 / 4, 1 / 2, 0.0])
    a0, c1, c2 = 3 / 4, 1 / 2, 0.0
    assert st.simulated_acceptance_length() == pytest.approx(1 + a0 + a0 * c1 + a0 * c1 * c2)
    assert st.simulated_acceptance_length(K=1) == pytest.approx(1 + a0)
    assert st.simulated_acceptance_length(K=2) == pytest.approx(1 + a0 + a0 * c1)
    assert st.acc_num.dtype == torch.float64

    # add / stacked / from_stacked round trip: counts add
    st2 = st.add(st)
    assert st2.accuracy() == pytest.approx(st.accuracy())
    assert torch.equal(st2.acc_den, 2 * st.acc_den)
    st3 = DepthStats.from_stacked(st.stacked())
    assert all(torch.equal(x, y) for x, y in zip(st3.as_tensor(), st.as_tensor()))


def test_depth_stats_perfect_chain_and_exclusions():
    K = 4
    anchor = torch.tensor([0, 1, 2, 0, 1, 0, 1, 0])
    depth = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    correct = torch.ones(8, dtype=torch.bool)
    st = depth_stats(anchor, depth, torch.ones(8), correct, torch.ones(8, dtype=torch.bool), K)
    assert st.simulated_acceptance_length() == pytest.approx(1 + K)  # all correct -> 1 + K
    # out-of-draft-vocab target at (1, 0) and unsupervised (2, 0): excluded from accuracy,
    # and chain 1's deeper elements no longer count as "given all shallower correct"
    in_vocab = torch.ones(8, dtype=torch.bool)
    in_vocab[1] = False
    weight = torch.ones(8)
    weight[2] = 0
    st = depth_stats(anchor, depth, weight, correct, in_vocab, K)
    assert st.acc_den.tolist() == [1, 2, 2, 1]
    assert st.cond_den.tolist() == [1, 1, 1, 1]
    assert st.accuracy() == [1.0, 1.0, 1.0, 1.0]


def test_depth_stats_empty_depth_stops_al():
    st = DepthStats.zeros(3)
    st.acc_num[0] = st.acc_den[0] = st.cond_num[0] = st.cond_den[0] = 2.0
    st.acc_den[0] = st.cond_den[0] = 4.0
    acc = st.accuracy()
    assert acc[0] == 0.5 and math.isnan(acc[1])
    assert st.simulated_acceptance_length() == pytest.approx(1.5)


def _depth_stats_reference(anchor, depth, weight, correct, in_vocab, K):
    """Plain-Python per-depth counts: accuracy, and accuracy given every shallower depth of the
    chain was supervised and correct."""
    ok = {(int(a), int(d)): bool(c) and bool(w > 0) and bool(v)
          for a, d, w, c, v in zip(anchor, depth, weight, correct, in_vocab)}
    sup = {(int(a), int(d)): bool(w > 0) and bool(v) for a, d, w, v in zip(anchor, depth, weight, in_vocab)}
    rows = [[0.0] * K for _ in range(4)]
    for (a, d), s in sup.items():
        rows[0][d] += ok[(a, d)]
        rows[1][d] += s
        if s and all(ok.get((a, j), False) for j in range(d)):
            rows[2][d] += ok[(a, d)]
            rows[3][d] += 1
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_depth_stats_equals_python_reference_sync_free_form(seed):
    """Random chains (each anchor has depths 0..L-1): the device-side counts equal a plain-Python
    reference, with and without ``n_anchors`` (the sync-free form the training step uses); an anchor
    beyond ``n_anchors`` is refused."""
    g = torch.Generator().manual_seed(seed)
    K, n = 5, 40
    lengths = torch.randint(0, K + 1, (n,), generator=g)
    anchor = torch.cat([torch.full((int(L),), a) for a, L in enumerate(lengths)])
    depth = torch.cat([torch.arange(int(L)) for L in lengths])
    perm = torch.randperm(anchor.numel(), generator=g)  # any element order
    anchor, depth = anchor[perm], depth[perm]
    E = anchor.numel()
    correct = torch.rand(E, generator=g) < 0.7
    weight = (torch.rand(E, generator=g) < 0.9).float()
    in_vocab = torch.rand(E, generator=g) < 0.95
    ref = _depth_stats_reference(anchor, depth, weight, correct, in_vocab, K)
    for n_anchors in (None, n, n + 7):
        st = depth_stats(anchor, depth, weight, correct, in_vocab, K, n_anchors=n_anchors)
        assert [t.tolist() for t in st.as_tensor()] == ref
    with pytest.raises(ValueError, match="n_anchors"):
        depth_stats(anchor, depth, weight, correct, in_vocab, K, n_anchors=int(anchor.max()))
