"""The Triton chain kernels (``peagle_train/kernels/chain_kernel.py``) under Triton's CPU interpreter.

Not collected by the main run (the name does not match ``test_*.py``): ``test_chain_kernel.py``
runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be set before the
kernels are defined, and in the main process it would send every ``chain_kernel: auto`` to the
interpreter). Run by hand::

    TRITON_INTERPRET=1 python -m pytest -q tests/unit/interp_chain_kernel.py

* float64: ``chain_attention(kernel="triton")`` ≡ the PyTorch chain part: output, lse and the
  q/k/v gradients under cotangents on both output and lse (1e-12), over the (queries, keys)
  pairs the trainer produces (hypothesis: self, EAGLE-3 steps, partition segments, subsets,
  padding), GQA with g = 1, 2, 3, 4, head dims 8 and 12 (padded tiles), strided q.
* Rows without a chain key: ``out = 0``, ``lse = -inf``, zero gradients; C = 0 and an empty grid;
  non-contiguous index tensors, a non-default scale, a tiling rounded to a power of two, NaN
  cotangents on rows without a key (gradients stay finite).
* The whole P-EAGLE objective with the triton chain part (prefix part dense) ≡ the dense-SDPA
  objective: loss and every parameter gradient (float64).
* ``benchmarks/chain_kernel.py`` runs (smoke) and writes its JSON.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the module docstring)", allow_module_level=True)
pytest.importorskip("triton")

from chain_kernel import fwd_bwd  # noqa: E402  (benchmarks/, on sys.path through conftest)

import peagle_train.kernels.chain_kernel as ck  # noqa: E402
from peagle_train.kernels.attention import chain_attention  # noqa: E402
from peagle_train.peagle.grid import pad_grid  # noqa: E402
from peagle_train.peagle.masks import GridMeta, build_chain_index, invert_chain_index  # noqa: E402
from tests.unit.test_attention import grid_case, make_grid  # noqa: E402
from tests.unit.test_split_attention import case_pair, check_split_objective_matches_sdpa  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _inputs(Eq, Ek, nh, nkv, hd, seed, dtype=torch.float64, strided=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Eq, nh, hd, generator=g, dtype=dtype) * 2
    q = q.transpose(1, 2) if strided else q.transpose(1, 2).contiguous()  # [1, nh, Eq, hd]
    k = torch.randn(1, nkv, Ek, hd, generator=g, dtype=dtype) * 2
    v = torch.randn(1, nkv, Ek, hd, generator=g, dtype=dtype)
    go = torch.randn(1, nh, Eq, hd, generator=g, dtype=dtype)
    gl = torch.randn(1, nh, Eq, generator=g, dtype=dtype)
    return q, k, v, go, gl


def _run(kernel, q, k, v, go, gl, index, valid, inverse, inverse_valid):
    """``(out, lse, dq, dk, dv)`` of ``chain_attention(kernel=kernel)`` (benchmarks/chain_kernel.py's
    ``fwd_bwd``, summed in float64)."""
    return fwd_bwd(functools.partial(chain_attention, kernel=kernel), q, k, v, go, gl, index, valid, inverse,
                   inverse_valid, acc=torch.float64)


@settings(max_examples=25, deadline=None)
@given(case=grid_case, data=st.data())
def test_triton_chain_equals_torch_float64(case, data):
    qm, km = case_pair(case, data)
    nkv, g = data.draw(st.sampled_from([(1, 1), (2, 2), (2, 3), (1, 4)]), label="nkv, g")
    hd = data.draw(st.sampled_from([8, 12]), label="hd")
    index, valid = build_chain_index(qm, km, min_chain=1)  # C >= 1 (split_attention skips C = 0; see below)
    inverse, inverse_valid = invert_chain_index(index, valid, len(km))
    q, k, v, go, gl = _inputs(len(qm), len(km), nkv * g, nkv, hd, case["seed"] % 1000,
                              strided=data.draw(st.booleans(), label="strided"))
    ref = _run("torch", q, k, v, go, gl, index, valid, inverse, inverse_valid)
    got = _run("triton", q, k, v, go, gl, index, valid, inverse, inverse_valid)
    assert got[1].dtype == torch.float64 and got[0].dtype == torch.float64
    for a, b in zip(got, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        fin = torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], atol=1e-12, rtol=1e-12)
    empty = ~valid.any(1)  # rows without a chain key: out 0, lse -inf, dq 0
    assert (got[0][:, :, empty] == 0).all() and torch.isneginf(got[1][:, :, empty]).all()
    assert (got[2][:, :, empty] == 0).all()


def test_no_chain_slots_and_empty_grid():
    """C = 0 (every query at depth 0): out 0, lse -inf, zero grads; an empty query set runs too."""
    g, _ = make_grid([20, 9], 2, 0.9, 1, 0.8, 0.3, None, 2)
    m = GridMeta.of(g)
    index, valid = build_chain_index(m)
    assert index.shape[1] == 0
    inverse, inverse_valid = invert_chain_index(index, valid, len(m))
    got = _run("triton", *_inputs(len(m), len(m), 4, 2, 8, 0), index, valid, inverse, inverse_valid)
    assert (got[0] == 0).all() and torch.isneginf(got[1]).all()
    assert all((t == 0).all() for t in got[2:])
    index0, valid0 = index[:0], valid[:0]
    out, lse = chain_attention(*_inputs(0, len(m), 4, 2, 8, 1)[:3], index0, valid0, inverse=inverse,
                               inverse_valid=inverse_valid, kernel="triton")
    assert out.shape == (1, 4, 0, 8) and lse.shape == (1, 4, 0)


def test_strided_index_custom_scale_odd_tiling_and_nonfinite_cotangents(monkeypatch):
    """Index tensors with non-contiguous storage, a non-default scale, a tiling whose row count is not
    a power of two (rounded down), and NaN cotangents on rows without a chain key: still ≡ torch
    (1e-12), and the gradients stay finite."""
    g, _ = make_grid([30, 17], 3, 0.9, 6, 0.8, 0.3, None, 3)
    m = GridMeta.of(pad_grid(g, 16))
    index, valid = build_chain_index(m)
    inverse, inverse_valid = invert_chain_index(index, valid, len(m))
    strided = [t.t().contiguous().t() for t in (index, valid, inverse, inverse_valid)]
    assert not strided[0].is_contiguous()
    monkeypatch.setitem(ck.TILING, "fwd", (3 * 4 * 8, 1))  # 3 rows -> 2
    q, k, v, go, gl = _inputs(len(m), len(m), 6, 2, 8, 5)
    empty = ~valid.any(1)
    assert empty.any()
    gl_nan = gl.clone()
    gl_nan[:, :, empty] = float("nan")  # a merge would never send these; the kernel must not spread them

    def run(kernel, idx, cot):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = chain_attention(qs, ks, vs, idx[0], idx[1], scale=0.3, inverse=idx[2], inverse_valid=idx[3],
                                   kernel=kernel)
        grads = torch.autograd.grad((out, lse), (qs, ks, vs), (go, cot))
        return (out, lse, *grads)

    ref = run("torch", (index, valid, inverse, inverse_valid), gl)
    got = run("triton", strided, gl_nan)
    for a, b in zip(got, ref):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin)
        torch.testing.assert_close(a[fin], b[fin], atol=1e-12, rtol=1e-12)
    assert all(torch.isfinite(t).all() for t in got[2:])


def test_objective_with_triton_chain_matches_sdpa_float64(tiny_drafter, objective_problem, monkeypatch):
    """The whole P-EAGLE objective, bucket-padded, split attention with the Triton chain part and the
    prefix part dense: loss and every parameter gradient equal the dense-SDPA objective's."""
    check_split_objective_matches_sdpa(tiny_drafter, objective_problem, monkeypatch, num_layers=2,
                                       chain_kernel="triton")


def test_benchmark_smoke(tmp_path):
    """``benchmarks/chain_kernel.py`` on the tiny shape: rows for both implementations, the sweep, and
    the best tiling it writes (which train_step.py --chain-tiling reads); TILING is restored."""
    import chain_kernel as bench

    before = dict(ck.TILING)
    out = tmp_path / "ck.json"
    bench.main(["--shape", "tiny", "--N", "24", "--K", "3", "--repeats", "1", "--pad-multiple", "16",
                "--tiling", "256,1", "512,2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert ck.TILING == before
    assert [r["impl"] for r in res["rows"][:2]] == ["torch", "triton"]
    sweep = [r for r in res["rows"] if r["kernel"] in ("fwd", "bwd_q", "bwd_kv")]
    assert len(sweep) == 6 and all(r["ms"] > 0 for r in sweep)
    assert set(res["best_tiling"]) == {"fwd", "bwd_q", "bwd_kv"}
    assert all(t in ([256, 1], [512, 2]) for t in res["best_tiling"].values())
    assert res["meta"]["interpreter"] is True
