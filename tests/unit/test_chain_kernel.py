"""The Triton chain kernels (``peagle_train/kernels/chain_kernel.py``) and how ``train.chain_kernel`` picks them.

* ``resolve``: ``auto`` is ``torch`` where Triton cannot run (CPU without the interpreter, or no
  Triton), ``triton`` there is a clear error, an unknown kind a ValueError; the config field is
  validated; the split masks record the resolved kind; ``chain_attention`` refuses an unknown
  kernel and ``triton`` without the inverse index; ``chain_attention_triton`` checks shapes.
* The kernels' math runs in ``interp_chain_kernel.py`` under ``TRITON_INTERPRET=1`` in a
  subprocess (float64 ≡ the PyTorch chain part, the whole objective ≡ SDPA, the benchmark
  smoke run); skipped only where Triton is not installed (``setup.sh --test`` installs it).
* On a CUDA machine: float64 / float32 / bfloat16, eager and compiled (``fullgraph``), against
  the PyTorch chain part in float64.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import run_under_triton_interpreter

import peagle_train.kernels.chain_kernel as ck
from peagle_train.core.config import ConfigError, TrainConfig
from peagle_train.kernels.attention import build_split_masks, chain_attention
from peagle_train.peagle.grid import pad_grid
from peagle_train.peagle.masks import GridMeta, build_chain_index, invert_chain_index
from tests.unit.test_attention import make_grid


def test_resolve(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert ck.resolve("auto", cpu) == "torch" and ck.resolve("torch", cpu) == "torch"
    with pytest.raises(RuntimeError, match="chain_kernel"):
        ck.resolve("triton", cpu)
    with pytest.raises(ValueError, match="unknown chain_kernel"):
        ck.resolve("cuda", cpu)
    monkeypatch.setattr(ck, "triton", None)  # no Triton at all: auto falls back everywhere
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ck.resolve("auto", torch.device("cuda")) == "torch"
    with pytest.raises(RuntimeError, match="not installed"):
        ck.resolve("triton", torch.device("cuda"))


def test_config_field_is_validated():
    assert TrainConfig().chain_kernel == "auto"
    assert TrainConfig(chain_kernel="torch").chain_kernel == "torch"
    with pytest.raises((ConfigError, ValueError), match="chain_kernel"):
        TrainConfig(chain_kernel="fast")


def test_split_masks_record_the_kernel_and_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g, _ = make_grid([20, 9], 2, 0.9, 4, 0.8, 0.3, None, 2)
    m = GridMeta.of(pad_grid(g, 16))
    assert build_split_masks(m, block_size=8).chain_kernel == "torch"
    assert build_split_masks(m, block_size=8, chain_kernel="auto").chain_kernel == "torch"  # CPU
    with pytest.raises(RuntimeError, match="chain_kernel"):
        build_split_masks(m, block_size=8, chain_kernel="triton")
    index, valid = build_chain_index(m)
    q, k, v = torch.randn(1, 4, len(m), 8), torch.randn(1, 2, len(m), 8), torch.randn(1, 2, len(m), 8)
    with pytest.raises(ValueError, match="unknown kernel"):
        chain_attention(q, k, v, index, valid, kernel="cuda")
    with pytest.raises(ValueError, match="inverse index"):
        chain_attention(q, k, v, index, valid, kernel="triton")
    inverse, inverse_valid = invert_chain_index(index, valid, len(m))
    with pytest.raises(ValueError, match="multiple"):
        ck.chain_attention_triton(torch.randn(1, 3, len(m), 8), k, v, index, valid, inverse, inverse_valid)
    with pytest.raises(ValueError, match="E_q"):
        ck.chain_attention_triton(q, k, v, index[1:], valid[1:], inverse, inverse_valid)
    with pytest.raises(ValueError, match="E_kv"):
        ck.chain_attention_triton(q, k, v, index, valid, inverse[1:], inverse_valid[1:])
    with pytest.raises(ValueError, match="batch must be 1"):
        ck.chain_attention_triton(q.expand(2, -1, -1, -1), k, v, index, valid, inverse, inverse_valid)
    with pytest.raises(ValueError, match="must match"):
        ck.chain_attention_triton(q, k, v.double(), index, valid, inverse, inverse_valid)
    with pytest.raises(ValueError, match="must match"):
        ck.chain_attention_triton(q, k[..., :4], v[..., :4], index, valid, inverse, inverse_valid)
    with pytest.raises(ValueError, match="inverse_valid"):
        ck.chain_attention_triton(q, k, v, index, valid, inverse, None)


def test_tiling_rows_are_powers_of_two(monkeypatch):
    """Rows per program = the power of two at or below elems / (g_pad * hd_pad), within 1..64."""
    monkeypatch.setitem(ck.TILING, "fwd", (3000, 4))
    assert ck._blocks(8, 64, "fwd") == (4, 8, 64, 4)  # 3000 / 512 = 5 -> 4
    assert ck._blocks(3, 12, "fwd") == (32, 4, 16, 4)  # 3000 / 64 = 46 -> 32
    monkeypatch.setitem(ck.TILING, "fwd", (10 ** 6, 8))
    assert ck._blocks(1, 8, "fwd")[0] == 64
    monkeypatch.setitem(ck.TILING, "fwd", (1, 1))
    assert ck._blocks(8, 64, "fwd")[0] == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed (setup.sh --test)")
def test_kernels_under_the_interpreter():
    """``interp_chain_kernel.py`` in a fresh process with ``TRITON_INTERPRET=1``: must pass, none skipped."""
    run_under_triton_interpreter("tests/unit/interp_chain_kernel.py", passed=5)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_kernels_match_torch_float64(dtype, compiled):
    """GPT-OSS-20B heads (64 query / 8 KV heads of 64) on a padded three-document COD grid with K = 8:
    the kernels (eager, and inside ``torch.compile(fullgraph=True)``) against the PyTorch chain part in
    float64. Measured on an H200 (docs/data/chain_kernel_s6_cuda_check.log): float64 ~5e-16,
    float32 ~2e-7, bfloat16 ~5e-3 relative to the largest entry."""
    from chain_kernel import fwd_bwd, split_args  # benchmarks/, on sys.path through conftest
    from train_step import max_rel_err

    dev = torch.device("cuda")
    g2 = pad_grid(make_grid([300, 170, 90], 20, 0.8, 8, 0.7, 0.2, None, 1)[0], 128)
    sm = build_split_masks(GridMeta.of(g2.to(dev)), min_chain=7, chain_kernel="triton")
    E, nh, nkv, hd = len(g2), 64, 8, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, go = (torch.randn(1, E, n, hd, device=dev, generator=gen).transpose(1, 2) for n in (nh, nkv, nh))
    v = torch.randn(1, nkv, E, hd, device=dev, generator=gen)
    gl = torch.randn(1, nh, E, device=dev, generator=gen)

    def run(fn, dt):
        return fwd_bwd(fn, *(t.to(dt) for t in (q, k, v, go)), gl, *split_args(sm), acc=torch.float64)

    def tri(*a, **kw):
        return chain_attention(*a, **kw, kernel="triton")

    ref = run(chain_attention, torch.float64)
    got = run(torch.compile(tri, fullgraph=True, dynamic=False) if compiled else tri, dtype)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(got, ref):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), fin)
        err = max_rel_err(a.double()[fin], b[fin])
        assert err < tol, (dtype, compiled, err)
