"""Pins the grid attention rule, its BlockMask and FlexAttention ≡ SDPA (PEAGLE_SPEC §3, ``attention.py``).

* ``dense_mask`` equals a plain-Python transcription of the rule, and the worked
  example of ``attention.py``'s docstring.
* Block mask ≡ dense reference (hypothesis: packed documents, trailing padding,
  COD samples with random ``r``/``r_min``/``max_anchors``, N up to ~300, K up to 10,
  several block sizes, Q == KV and Q != KV such as EAGLE-3's step-k queries over the
  concatenated keys of steps ≤ k, partition segments, padded metadata): every allowed
  pair lies in a partial-or-full block, full blocks contain only allowed pairs (also
  in the transposed q-block view used by the backward kernels), the
  mask_mod equals ``dense_mask`` at every pair, and the element-level mask the
  kernel computes (full blocks, plus mask_mod on partial blocks) equals ``dense_mask``.
* The build never materialises an ``E × E`` tensor: ``build_block_mask`` on an
  8192 × 8 grid (E ≈ 65k, E² bytes = 4 GiB) runs in a subprocess in well under the
  E² memory and a few seconds.
* FlexAttention output ≡ SDPA with the dense mask (CPU, float32, forward only:
  flex has no CPU backward) for direct attention calls; through the whole ``Drafter``
  forward in ``tests/unit/test_split_attention.py`` (split, joint and SDPA side by side).
  Note: eager flex on CPU evaluates only the ``mask_mod``; the block structure is
  checked by the effective-mask test above and, once, by the compiled CPU flex kernel
  (which does skip/trust blocks).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from peagle_train.kernels.attention import AttnSpec, attend, make_attn_spec
from peagle_train.peagle.grid import build_grid, cod_sample
from peagle_train.peagle.masks import GridMeta, allowed, build_block_mask, dense_mask, make_mask_mod

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# ----------------------------------------------------------------------------- helpers


def ref_allowed(qa, qd, qdoc, ka, kd, kdoc) -> bool:
    """The spec §3 rule, one pair at a time."""
    if qdoc < 0 or kdoc < 0 or qdoc != kdoc:
        return False
    return (kd == 0 and ka <= qa) or (ka == qa and kd <= qd)


def ref_dense(q: GridMeta, kv: GridMeta, rule=ref_allowed) -> torch.Tensor:
    """``rule`` (default: the whole rule) at every (query, key) pair, one pair at a time."""
    Q = list(zip(q.anchor.tolist(), q.depth.tolist(), q.doc.tolist()))
    Kv = list(zip(kv.anchor.tolist(), kv.depth.tolist(), kv.doc.tolist()))
    return torch.tensor([[rule(*a, *b) for b in Kv] for a in Q], dtype=torch.bool).view(len(Q), len(Kv))


def make_grid(lens, n_pad, loss_prob, K, r, r_min, max_anchors, seed, mask_token_id=127):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lens)]
                        + [torch.full((n_pad,), -1, dtype=torch.int64)])
    N = doc_ids.numel()
    x = torch.randint(0, mask_token_id, (N,), generator=g)
    loss_mask = (torch.rand(N, generator=g) < loss_prob) & (doc_ids >= 0)
    kept = cod_sample(loss_mask, doc_ids, K, r, r_min, max_anchors, generator=g)
    return build_grid(x, loss_mask, doc_ids, kept, mask_token_id), x


def cat_meta(*ms: GridMeta) -> GridMeta:
    return GridMeta(*(torch.cat(t) for t in zip(*((m.anchor, m.depth, m.doc) for m in ms))))


def sub_meta(m: GridMeta, idx: torch.Tensor) -> GridMeta:
    return GridMeta(m.anchor[idx], m.depth[idx], m.doc[idx])


def decode_blocks(num: torch.Tensor, idx: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """``[1,1,nQB]`` counts + ``[1,1,nQB,*]`` indices -> bool ``[nQB, nKB]`` (independent of torch helpers)."""
    nqb = num.shape[-1]
    out = torch.zeros(nqb, n_kv_blocks, dtype=torch.bool)
    for i in range(nqb):
        cols = idx[0, 0, i, : int(num[0, 0, i])].long()
        assert cols.unique().numel() == cols.numel(), "duplicate kv block index"
        out[i, cols] = True
    return out


def check_block_mask(q: GridMeta, kv: GridMeta, block_size: int):
    """All block-mask ≡ dense-mask assertions for one (q, kv) pair. Returns (partial, full) block masks."""
    Eq, Ek = len(q), len(kv)
    bm = build_block_mask(q, kv, block_size=block_size)
    assert tuple(bm.seq_lengths) == (Eq, Ek)
    bq, bk = bm.BLOCK_SIZE
    assert (bq, bk) == (block_size, block_size)
    nqb, nkb = -(-Eq // bq), -(-Ek // bk)
    assert bm.kv_num_blocks.shape[-1] == nqb
    partial = decode_blocks(bm.kv_num_blocks, bm.kv_indices, nkb)
    full = decode_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, nkb)
    assert not (partial & full).any(), "a block is both partial and full"
    assert torch.equal(bm.to_dense()[0, 0].bool(), partial | full)
    # the transposed (q-block) view the backward kernels read agrees with the kv view
    assert torch.equal(decode_blocks(bm.q_num_blocks, bm.q_indices, nqb), partial.T)
    assert torch.equal(decode_blocks(bm.full_q_num_blocks, bm.full_q_indices, nqb), full.T)

    dense = dense_mask(q, kv)
    if Eq * Ek <= 40_000:  # the pure-Python transcription is slow; larger cases rely on the small ones
        assert torch.equal(dense, ref_dense(q, kv))
    # mask_mod at every pair == dense reference (element level, via torch's create_mask)
    mm = create_mask(bm.mask_mod, 1, 1, Eq, Ek, device="cpu")[0, 0]
    assert torch.equal(mm, dense)

    blk_q = torch.arange(Eq) // bq
    blk_k = torch.arange(Ek) // bk
    part_e = partial[blk_q][:, blk_k]  # [Eq, Ek] block membership per element pair
    full_e = full[blk_q][:, blk_k]
    # 1. every allowed pair lies in a partial-or-full block
    assert not (dense & ~(part_e | full_e)).any(), "allowed pair in a skipped block"
    # 2. every full block has all its pairs allowed (incl. never containing out-of-range rows/cols)
    assert not (full_e & ~dense).any(), "full block with a disallowed pair"
    for i, j in full.nonzero().tolist():
        assert (i + 1) * bq <= Eq and (j + 1) * bk <= Ek, "full block sticks out of the sequence"
    # 3. what the kernel computes: full blocks, plus mask_mod inside partial blocks
    effective = full_e | (part_e & mm)
    assert torch.equal(effective, dense)
    return partial, full


grid_case = st.fixed_dictionaries({
    # at least one document of >= 2 tokens, so the grid is not empty
    "lens": st.lists(st.integers(1, 70), min_size=1, max_size=5).filter(lambda ls: max(ls) >= 2),
    "n_pad": st.integers(0, 10),
    "loss_prob": st.sampled_from([0.4, 0.8, 1.0]),
    "K": st.integers(1, 10),
    "r": st.floats(0.3, 1.0),
    "r_min": st.floats(0.0, 0.6),
    "max_anchors": st.one_of(st.none(), st.integers(1, 50)),
    "seed": st.integers(0, 2**31 - 1),
    "block_size": st.sampled_from([8, 16, 32, 128]),
})


# ----------------------------------------------------------------------------- the rule


def test_docstring_worked_example():
    m = GridMeta(torch.tensor([0, 1, 2, 1, 1]), torch.tensor([0, 0, 0, 1, 2]), torch.zeros(5, dtype=torch.int64))
    expect = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(dense_mask(m), expect)
    assert torch.equal(dense_mask(m, m), expect)


def test_rule_documents_and_padding():
    # two docs + a padding element; same anchors/depths in different docs never see each other
    m = GridMeta(torch.tensor([0, 1, 2, 3, 2, 0]), torch.tensor([0, 0, 0, 0, 1, 0]), torch.tensor([0, 0, 1, 1, 1, -1]))
    d = dense_mask(m)
    assert torch.equal(d, ref_dense(m, m))
    assert not d[:2, 2:].any() and not d[2:, :2].any()
    assert not d[5].any() and not d[:, 5].any()  # padding neither attends nor is attended
    assert d[4].tolist() == [False, False, True, False, True, False]  # (2,1): prefix (2,0) + itself, not (3,0)
    t = torch.tensor
    assert allowed(t(3), t(2), t(0), t(3), t(1), t(0))  # own chain, shallower depth
    assert not allowed(t(3), t(2), t(0), t(2), t(1), t(0))  # another chain's depth-1 element


# ----------------------------------------------------------------------------- block mask ≡ dense


@settings(max_examples=50, deadline=None)
@given(case=grid_case)
def test_block_mask_equals_dense_self(case):
    g, _ = make_grid(case["lens"], case["n_pad"], case["loss_prob"], case["K"], case["r"], case["r_min"],
                     case["max_anchors"], case["seed"])
    m = GridMeta.of(g)
    check_block_mask(m, m, case["block_size"])


@settings(max_examples=40, deadline=None)
@given(case=grid_case, data=st.data())
def test_block_mask_equals_dense_q_ne_kv(case, data):
    g, _ = make_grid(case["lens"], case["n_pad"], case["loss_prob"], case["K"], case["r"], case["r_min"],
                     case["max_anchors"], case["seed"])
    m = GridMeta.of(g)
    bs = case["block_size"]
    # EAGLE-3 TTT: step-k queries over the concatenated keys of steps 0..k
    K = int(g.depth.max()) + 1
    k = data.draw(st.integers(0, K - 1), label="step")
    steps = [sub_meta(m, (g.depth == j).nonzero().flatten()) for j in range(k + 1)]
    check_block_mask(steps[-1], cat_meta(*steps), bs)
    # a random subset of queries (e.g. one partition segment's owned rows) over the full grid
    sel = torch.tensor(sorted(data.draw(st.sets(st.integers(0, len(m) - 1), min_size=1, max_size=len(m)),
                                        label="rows")))
    check_block_mask(sub_meta(m, sel), m, bs)
    # metadata padded with padding elements (doc = -1), on both sides
    extra = data.draw(st.integers(1, 40), label="pad")
    check_block_mask(m.padded(len(m) + extra), m.padded(len(m) + extra // 2 + 1), bs)


def test_block_mask_is_tight_for_plain_causal():
    """One document, depth 0 only (= plain causal): diagonal blocks partial, strictly-lower blocks full."""
    n, bs = 512, 64
    m = GridMeta(torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    partial, full = check_block_mask(m, m, bs)
    nb = n // bs
    assert torch.equal(partial, torch.eye(nb, dtype=torch.bool))
    assert torch.equal(full, torch.ones(nb, nb, dtype=torch.bool).tril(-1))


def test_block_mask_skips_other_documents():
    """Two long documents: no block pairs a query of doc 1 with keys of doc 0 only."""
    n, bs = 256, 32
    m = GridMeta(torch.arange(2 * n) % n, torch.zeros(2 * n, dtype=torch.int64), torch.arange(2 * n) // n)
    partial, full = check_block_mask(m, m, bs)
    nb = n // bs
    assert not (partial | full)[nb:, :nb].any()


def test_block_mask_no_dense_materialisation_at_scale():
    """8192 × 8 grid (E ≈ 65k): build in a fresh process, peak RSS far below E² bytes, a few seconds."""
    code = textwrap.dedent("""
        import resource, time, torch
        from peagle_train.peagle.masks import GridMeta, build_block_mask, block_structure
        from peagle_train.peagle.grid import build_grid, cod_sample
        N, K = 8192, 8
        lm = torch.ones(N, dtype=torch.bool)
        doc = torch.zeros(N, dtype=torch.int64); doc[5000:] = 1
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        kept = cod_sample(lm, doc, K, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
        g = build_grid(torch.zeros(N, dtype=torch.int64), lm, doc, kept, 5)
        m = GridMeta.of(g)
        E = len(m)
        pad = -(-E // 128) * 128
        partial, full = block_structure(m.padded(pad), m.padded(pad), 128)
        bm = build_block_mask(m)
        dt = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(E, dt, (peak - base) * 1024, int(partial.sum()), int(full.sum()), partial.numel())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]), env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    E, dt, grown, n_partial, n_full, n_blocks = out.stdout.split()
    E, dt, grown = int(E), float(dt), int(grown)
    assert E > 65000
    assert dt < 10.0, f"block mask build took {dt:.1f}s"  # ~0.1 s unloaded; slack for a busy CI box
    assert grown < E * E / 16, f"RSS grew by {grown / 2**20:.0f} MiB (E² = {E * E / 2**30:.1f} GiB)"
    # and it is actually sparse: well under half the blocks are computed
    assert int(n_partial) + int(n_full) < 0.5 * int(n_blocks)


# ----------------------------------------------------------------------------- flex ≡ sdpa


def manual_attention(q, k, v, mask):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


@settings(max_examples=30, deadline=None)
@given(case=grid_case, data=st.data())
def test_flex_equals_sdpa_direct(case, data):
    g, _ = make_grid(case["lens"], case["n_pad"], case["loss_prob"], min(case["K"], 6), case["r"], case["r_min"],
                     case["max_anchors"], case["seed"])
    m = GridMeta.of(g)
    K = int(g.depth.max()) + 1
    k_step = data.draw(st.integers(0, K - 1), label="step")
    if data.draw(st.booleans(), label="q_ne_kv"):
        steps = [sub_meta(m, (g.depth == j).nonzero().flatten()) for j in range(k_step + 1)]
        qm, km = steps[-1], cat_meta(*steps)
    else:
        qm, km = m, m
    torch.manual_seed(case["seed"] % 1000)
    nh, nkv, hd = 4, 2, 8
    q = torch.randn(1, nh, len(qm), hd) * 2
    k = torch.randn(1, nkv, len(km), hd) * 2
    v = torch.randn(1, nkv, len(km), hd)
    flex = attend(q, k, v, make_attn_spec(qm, km, kind="flex"))
    sdpa = attend(q, k, v, make_attn_spec(qm, km, kind="sdpa"))
    ref = manual_attention(q, k, v, ref_dense(qm, km))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="needs a C++ compiler")
def test_compiled_cpu_flex_honours_block_mask():
    """The compiled CPU flex kernel (which skips empty blocks and applies no mask_mod on full
    blocks) equals SDPA with the dense mask on a multi-document COD grid (block size 128)."""
    from torch.nn.attention.flex_attention import flex_attention

    g, _ = make_grid([300, 200], 7, 0.9, 4, 0.7, 0.2, None, 0)
    m = GridMeta.of(g)
    partial, full = check_block_mask(m, m, 128)
    assert full.any() and partial.any() and not (partial | full).all()
    torch.manual_seed(0)
    E = len(m)
    q, k, v = (torch.randn(1, 2, E, 16) for _ in range(3))
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=build_block_mask(m))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(m)[None, None])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_make_attn_spec_kinds():
    m = GridMeta(torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    assert make_attn_spec(m, kind="sdpa").dense.shape == (4, 4)
    assert make_attn_spec(m, kind="flex").split is not None  # the split form (test_split_attention.py)
    assert make_attn_spec(m, kind="flex_joint").block_mask is not None
    with pytest.raises(ValueError):
        make_attn_spec(m, kind="dense")
    with pytest.raises(ValueError):
        AttnSpec()
    mm = make_mask_mod(m, m)
    assert bool(mm(0, 0, torch.tensor(3), torch.tensor(1))) and not bool(mm(0, 0, torch.tensor(1), torch.tensor(3)))


# ----------------------------------------------------------------------------- flex_flash (FlashAttention-4)


def test_flex_flash_spec_and_cpu_math():
    """``flex_flash`` is the joint rule's ``BlockMask`` with ``BACKEND: FLASH``; on a CPU eager FlexAttention runs
    the same rule without the option, so its output equals flex_joint's and SDPA's with the dense mask (float64,
    a multi-document COD grid with GQA)."""
    from peagle_train.kernels.attention import FLASH_KERNEL_OPTIONS

    g, _ = make_grid([40, 25], 3, 0.9, 4, 0.7, 0.2, None, 1)
    m = GridMeta.of(g)
    spec = make_attn_spec(m, kind="flex_flash")
    assert spec.block_mask is not None and spec.kernel_options == FLASH_KERNEL_OPTIONS == (("BACKEND", "FLASH"),)
    assert make_attn_spec(m, kind="flex_joint").kernel_options is None
    torch.manual_seed(0)
    E = len(m)
    q = torch.randn(1, 4, E, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, E, 8, dtype=torch.float64) for _ in range(2))
    flash = attend(q, k, v, spec)
    joint = attend(q, k, v, make_attn_spec(m, kind="flex_joint"))
    ref = manual_attention(q, k, v, ref_dense(m, m))
    torch.testing.assert_close(flash, joint, atol=0, rtol=0)
    torch.testing.assert_close(flash, ref, atol=1e-10, rtol=1e-10)


def test_flex_flash_options_reach_the_kernel(monkeypatch):
    """On CUDA inputs the real ``attend`` → ``_flex`` → ``_flex_call`` path hands ``BACKEND: FLASH`` to the compiled
    FlexAttention and adds no ``IS_DIVISIBLE`` (an option of Inductor's Triton templates); the Triton kinds get the
    hint. The compiled kernel is a stand-in that records its keywords (no GPU here)."""
    import peagle_train.kernels.attention as attention_mod
    from peagle_train.kernels import compiling

    seen = {}

    def recorder(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setitem(attention_mod._FLEX_COMPILED, compiling.DYNAMIC, recorder)

    class CudaLike:  # what _flex and divisible_options read: is_cuda and the length
        is_cuda = True
        shape = (1, 4, 1024, 64)

    m = GridMeta(torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    attend(CudaLike(), CudaLike(), CudaLike(), make_attn_spec(m, kind="flex_flash"))
    assert seen["kernel_options"] == {"BACKEND": "FLASH"} and seen["enable_gqa"] is True
    seen.clear()
    attend(CudaLike(), CudaLike(), CudaLike(), make_attn_spec(m, kind="flex_joint"))
    assert seen["kernel_options"] == {"IS_DIVISIBLE": True}
    with pytest.raises(ValueError, match="block_mask kernel only"):
        AttnSpec(dense=torch.ones(2, 2, dtype=torch.bool), kernel_options=(("BACKEND", "FLASH"),))


def test_flex_flash_backend_dropped_off_cuda():
    """Eager FlexAttention given ``BACKEND: FLASH`` on a CPU returns its log-sum-exp in another base; ``_flex`` drops
    the option off CUDA, so the split form's merge would read the natural-log lse: equal to the call without it."""
    from peagle_train.kernels.attention import _flex

    g, _ = make_grid([30, 20], 2, 0.9, 3, 0.7, 0.2, None, 2)
    m = GridMeta.of(g)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, len(m), 8, dtype=torch.float64) for _ in range(3))
    bm = build_block_mask(m)
    out_f, lse_f = _flex(q, k, v, bm, return_lse=True, kernel_options={"BACKEND": "FLASH"})
    out, lse = _flex(q, k, v, bm, return_lse=True)
    torch.testing.assert_close(out_f, out, atol=0, rtol=0)
    torch.testing.assert_close(lse_f, lse, atol=0, rtol=0)


def test_flex_flash_refused_where_it_cannot_run():
    """``train.attention: flex_flash`` is refused at set-up with what to do where FlashAttention-4 cannot run (a
    CPU here), before anything compiles; the other kinds resolve as before."""
    from peagle_train.core.config import ConfigError
    from peagle_train.kernels.attention import flash_unavailable_reason
    from peagle_train.trainer.setup import resolve_attention

    cpu = torch.device("cpu")
    assert "CUDA only" in flash_unavailable_reason(cpu)
    with pytest.raises(ConfigError, match="train.attention: flex_flash cannot run here.*flash-attn-4"):
        resolve_attention("flex_flash", cpu)
    assert resolve_attention("auto", cpu) == "sdpa" and resolve_attention("flex_joint", cpu) == "flex_joint"


@pytest.mark.parametrize("capability, spec, expect", [
    ((8, 0), "found", "compute capability 9 or 10 (this GPU has 8.x)"),
    ((9, 0), None, "not installed (pip install flash-attn-4)"),
    ((9, 0), ImportError("broken flash_attn"), "cannot be imported (broken flash_attn)"),
    ((10, 0), "found", None),
    (RuntimeError("no CUDA"), "found", "cannot be read (no CUDA)"),
])
def test_flash_unavailable_reason_on_gpus(monkeypatch, capability, spec, expect):
    """The GPU checks of ``flex_flash`` without a GPU: the capability and the package lookup stood in for; a broken
    package or an unreadable capability is a reason, never an exception."""
    import importlib.util

    import peagle_train.kernels.attention as attention_mod

    def fake_capability(device):
        if isinstance(capability, Exception):
            raise capability
        return capability

    def fake_find_spec(name):
        assert name == "flash_attn.cute"
        if isinstance(spec, Exception):
            raise spec
        return spec

    monkeypatch.setattr(attention_mod, "device_capability", fake_capability)
    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    why = attention_mod.flash_unavailable_reason(torch.device("cuda", 0))
    assert why is None if expect is None else expect in why


def test_flex_flash_compiles_static_and_needs_bf16():
    """``flex_flash`` compiles one graph per bucket whatever ``train.dynamic_shapes`` says (warning where it
    overrides true); the other kinds keep the setting; the recipe is refused without bf16 autocast."""
    from peagle_train.core.config import TrainConfig
    from peagle_train.trainer.setup import dynamic_shapes_for

    with pytest.warns(UserWarning, match="flex_flash compiles one graph per 1,024-element grid bucket"):
        assert dynamic_shapes_for("flex_flash", True) is False
    assert dynamic_shapes_for("flex_flash", False) is False
    assert dynamic_shapes_for("flex", True) is True and dynamic_shapes_for("flex_joint", False) is False
    assert TrainConfig(attention="flex_flash", mixed_precision="bf16").attention == "flex_flash"
    with pytest.raises(ValueError, match="flex_flash needs train.mixed_precision=bf16"):
        TrainConfig(attention="flex_flash")
