"""data_prep.gqa_decode_attention: the decoding attention that folds grouped query heads instead of
expanding the KV cache equals transformers' SDPA attention; generation with it is token-identical."""
from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from conftest import run_under_triton_interpreter

from data_prep.gqa_decode_attention import NAME, decode_attention, gqa_decode_sdpa, resolve_kernel


def _sdpa(*a, **k):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*a, **k)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_folded_decode_step_equals_transformers_sdpa(mask_kind):
    torch.manual_seed(0)
    B, H, Hkv, L, d = 3, 9, 3, 11, 8
    module = types.SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True)
    q = torch.randn(B, H, 1, d, dtype=torch.float64)
    k, v = torch.randn(B, Hkv, L, d, dtype=torch.float64), torch.randn(B, Hkv, L, d, dtype=torch.float64)
    keep = torch.ones(B, 1, 1, L + 2, dtype=torch.bool)  # longer than the keys: sliced as transformers does
    keep[0, ..., :4] = False  # left padding of row 0
    keep[2, ..., :7] = False
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e30)
    got, _ = gqa_decode_sdpa(module, q, k, v, mask, scaling=0.3)
    want, _ = _sdpa(module, q, k, v, mask[..., :L], scaling=0.3)
    assert got.shape == (B, 1, H, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # query head h uses KV head h // 3: moving KV head 1 changes only query heads 3..5
    k2 = k.clone()
    k2[:, 1] += 1
    moved, _ = gqa_decode_sdpa(module, q, k2, v, mask, scaling=0.3)
    changed = (moved - got).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.tolist() == [False] * 3 + [True] * 3 + [False] * 3


def test_prefill_and_ungrouped_heads_fall_back_to_transformers_sdpa():
    torch.manual_seed(1)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    got, _ = gqa_decode_sdpa(module, q, k, v, None)  # prefill: causal, no mask
    want, _ = _sdpa(module, q, k, v, None)
    assert torch.equal(got, want)


def check_static_generation_on(kernel: str, name: str, fn, counts) -> None:
    """A tiny GQA Llama: static-cache generate under ``decode_attention(model, kernel)`` gives plain generate's tokens
    on a left-padded batch, every decoding step of every layer goes through ``fn`` (registered under ``name``) where
    ``counts(query, mask)``, and the model's attention implementation is restored after."""
    from transformers import AttentionInterface, LlamaForCausalLM

    from tests.conftest import _tiny_llama_config

    torch.manual_seed(0)
    cfg = _tiny_llama_config()
    cfg.num_key_value_heads = max(1, cfg.num_attention_heads // 2)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, cfg.vocab_size, (3, 9))
    att = torch.ones_like(ids)
    att[0, :4] = 0
    att[2, :2] = 0
    kw = dict(input_ids=ids, attention_mask=att, max_new_tokens=12, do_sample=False, pad_token_id=0)
    steps = []

    def spy(module, query, key, value, mask, *a, **k):
        steps.append(counts(query, mask))
        return fn(module, query, key, value, mask, *a, **k)

    with torch.no_grad():
        plain = model.generate(**kw)
        with decode_attention(model, kernel):
            assert model.config._attn_implementation == name
            AttentionInterface.register(name, spy)
            static = model.generate(**kw, cache_implementation="static")
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(static, plain)
    assert sum(steps) == 11 * cfg.num_hidden_layers  # every decoding step after the prefill, every layer


def test_static_generation_with_the_folded_attention_is_token_identical():
    """A tiny GQA Llama: static-cache generate under decode_attention gives plain generate's tokens on a
    left-padded batch, and the model's attention implementation is restored after."""
    check_static_generation_on("sdpa", NAME, gqa_decode_sdpa,
                               lambda query, mask: query.shape[2] == 1 and mask is not None)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed (setup.sh --test)")
def test_split_k_kernel_under_the_interpreter():
    """``interp_decode_kernel.py`` in a fresh process with ``TRITON_INTERPRET=1``: the Triton decoding kernel
    ≡ masked SDPA in float64, and static generation on it is token-identical; must pass, none skipped."""
    run_under_triton_interpreter("tests/unit/interp_decode_kernel.py", passed=7)


def test_decode_kernel_setting_resolves_and_bad_values_are_refused(monkeypatch):
    from data_prep.config import RegenConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_kernel("auto", "cpu") == "sdpa"  # no CUDA: the SDPA fold
    assert resolve_kernel("sdpa", "cpu") == "sdpa"
    with pytest.raises(RuntimeError, match="regen.decode_kernel: triton needs Triton and a CUDA device"):
        resolve_kernel("triton", "cpu")
    with pytest.raises(ValueError, match="unknown regen.decode_kernel 'fast'"):
        resolve_kernel("fast", "cpu")
    with pytest.raises(ValueError, match="regen.decode_kernel is a setting of regen.backend: hf"):
        RegenConfig(backend="vllm", decode_kernel="triton")
    with pytest.raises(ValueError):
        RegenConfig(decode_kernel="flash")
    from data_prep.decode_attention_kernel import gqa_decode_attention

    q, kv = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 5, 8)
    with pytest.raises(RuntimeError, match="set regen.decode_kernel: sdpa"):
        gqa_decode_attention(q, kv, kv, torch.ones(1, 5, dtype=torch.bool), 1.0)


def test_kept_range_and_combine_partials_worked_examples():
    from data_prep.decode_attention_kernel import combine_partials, kept_range

    start, end = kept_range(torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool))
    assert start.tolist() == [2, 0, 0] and end.tolist() == [4, 0, 5]
    # two splits of one query: scores (log2 units) [1, 2] in split 0 and [3] in split 1, values 10, 20, 30
    m = torch.tensor([[[2.0], [3.0]]])
    l = torch.tensor([[[2.0 ** -1 + 1.0], [1.0]]])
    o = torch.tensor([[[[10 * 2.0 ** -1 + 20.0]], [[30.0]]]])
    p = torch.tensor([2.0 ** 1, 2.0 ** 2, 2.0 ** 3])
    want = (p * torch.tensor([10.0, 20.0, 30.0])).sum() / p.sum()
    torch.testing.assert_close(combine_partials(o, m, l), want.reshape(1, 1, 1))
    empty = combine_partials(torch.zeros(1, 2, 1, 1), torch.full((1, 2, 1), float("-inf")), torch.zeros(1, 2, 1))
    assert torch.equal(empty, torch.zeros(1, 1, 1))  # no kept key: 0, not NaN


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_eager_and_compiled_match_masked_sdpa(dtype):
    """On a GPU: the split-K kernel, eagerly and inside ``torch.compile(fullgraph=True)`` (as the static engine's
    compiled decoding step runs it), against masked SDPA in float32 on SmolLM2's heads over a left-padded cache
    with an unwritten tail and several splits per row."""
    from data_prep.decode_attention_kernel import gqa_decode_attention

    g = torch.Generator(device="cpu").manual_seed(0)
    B, Hkv, G, L, D = 8, 3, 3, 700, 64
    q, k, v = (torch.randn(*s, generator=g).cuda().to(dtype) for s in ((B, Hkv, G, D), (B, Hkv, L, D), (B, Hkv, L, D)))
    j = torch.arange(L, device="cuda")
    start = torch.tensor([0, 5, 100, 250, 0, 699, 30, 64], device="cuda")
    keep = (j[None, :] >= start[:, None]) & (j[None, :] <= 699 - torch.arange(B, device="cuda")[:, None] * 40)
    keep[5, 699] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=keep[:, None, None, :].expand(B, Hkv, G, L), scale=D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    eager = gqa_decode_attention(q, k, v, keep, D ** -0.5)
    compiled = torch.compile(lambda *a: gqa_decode_attention(*a, D ** -0.5), fullgraph=True)(q, k, v, keep)
    for got in (eager, compiled):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)
