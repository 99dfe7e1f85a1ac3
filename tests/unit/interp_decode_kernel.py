"""The split-K decoding kernel (``data_prep/decode_attention_kernel.py``) under Triton's CPU interpreter.

Not collected by the main run (the name does not match ``test_*.py``): ``test_gqa_decode_attention.py``
runs this file in a subprocess with ``TRITON_INTERPRET=1`` (set before the kernel is defined). By hand::

    TRITON_INTERPRET=1 python -m pytest -q tests/unit/interp_decode_kernel.py

* float64: the kernel ≡ masked SDPA (1e-12) for group sizes 1–4 and head dims 8–64 (padded tiles), over
  masks with left padding, an unwritten cache tail, holes inside the kept range, a row that keeps one
  key, several splits per row and strided (sliced) key/value/mask views; a row with no kept key gives 0.
* transformers' attention function (:func:`gqa_decode_triton`) ≡ transformers' SDPA on a decoding step.
* A tiny grouped-query Llama (float32, SDPA) generates with a static cache under
  ``decode_attention(model, "triton")`` the tokens of plain ``generate`` on a left-padded batch, with
  every decoding step of every layer on the kernel.
"""
from __future__ import annotations

import os
import types

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the module docstring)", allow_module_level=True)
pytest.importorskip("triton")

from data_prep import decode_attention_kernel as dk  # noqa: E402
from data_prep.gqa_decode_attention import NAME_TRITON, gqa_decode_triton, resolve_kernel  # noqa: E402
from tests.unit.test_gqa_decode_attention import check_static_generation_on  # noqa: E402


def _masked_sdpa(q, k, v, keep, scale):
    B, Hkv, G, _ = q.shape
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep[:, None, None, :].expand(B, Hkv, G, keep.shape[1]), scale=scale)


@pytest.mark.parametrize("G,D,L,chunk", [(1, 8, 70, 64), (3, 8, 300, 128), (2, 12, 200, 64), (4, 64, 513, 256)])
def test_kernel_equals_masked_sdpa_float64(G, D, L, chunk):
    g = torch.Generator().manual_seed(G * 1000 + L)
    B, Hkv = 4, 2
    q = torch.randn(B, Hkv, G, D, generator=g, dtype=torch.float64) * 2
    # strided key/value views: a longer cache sliced as transformers slices it
    k = torch.randn(B, Hkv, L + 5, D, generator=g, dtype=torch.float64)[:, :, :L]
    v = torch.randn(B, Hkv, L + 5, D, generator=g, dtype=torch.float64)[:, :, :L]
    full = torch.ones(B, 1, 1, L + 3, dtype=torch.bool)
    full[0, ..., :37] = False  # left padding
    full[0, ..., L // 2:] = False  # unwritten cache tail
    full[1, ..., :L - 1] = False  # keeps only its last key
    full[2, ..., 5:9] = False  # holes inside the kept range
    full[2, ..., L // 3: L // 3 + 70] = False
    keep = full[:, 0, 0, :L]  # a strided view, as gqa_decode_triton passes it
    out = dk.gqa_decode_attention(q, k, v, keep, 0.37, chunk)
    torch.testing.assert_close(out, _masked_sdpa(q, k, v, keep, 0.37), rtol=0, atol=1e-12)
    none = torch.zeros(B, L, dtype=torch.bool)
    assert torch.equal(dk.gqa_decode_attention(q, k, v, none, 0.37, chunk), torch.zeros_like(q))


def test_kernel_float32_close_to_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 3, 64, generator=g, dtype=torch.float64) if i == 0 else
               torch.randn(2, 3, 400, 64, generator=g, dtype=torch.float64) for i in range(3))
    keep = torch.ones(2, 400, dtype=torch.bool)
    keep[0, :120] = False
    want = _masked_sdpa(q, k, v, keep, 0.125)
    got = dk.gqa_decode_attention(q.float(), k.float(), v.float(), keep, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_attention_function_equals_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    B, H, Hkv, L, d = 3, 9, 3, 140, 16
    module = types.SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True)
    q = torch.randn(B, H, 1, d, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, L, d, dtype=torch.float64), torch.randn(B, Hkv, L, d, dtype=torch.float64)
    mask = torch.ones(B, 1, 1, L + 2, dtype=torch.bool)
    mask[0, ..., :40] = False
    mask[2, ..., 100:] = False
    got, _ = gqa_decode_triton(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask[..., :L], scaling=0.3)
    assert got.shape == (B, 1, H, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert resolve_kernel("auto", "cpu") == "triton"  # the interpreter runs it on CPU


def test_static_generation_on_the_kernel_is_token_identical():
    check_static_generation_on("triton", NAME_TRITON, gqa_decode_triton,
                               lambda query, mask: query.shape[2] == 1 and mask is not None
                               and mask.dtype == torch.bool)
