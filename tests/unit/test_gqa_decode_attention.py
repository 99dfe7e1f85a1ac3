"""data_prep.gqa_decode_attention: the decoding attention that folds grouped query heads instead of
expanding the KV cache equals transformers' SDPA attention; generation with it is token-identical."""
from __future__ import annotations

import types

import pytest
import torch

from data_prep.gqa_decode_attention import NAME, decode_attention, gqa_decode_sdpa


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


def test_static_generation_with_the_folded_attention_is_token_identical():
    """A tiny GQA Llama: static-cache generate under decode_attention gives plain generate's tokens on a
    left-padded batch, and the model's attention implementation is restored after."""
    from transformers import LlamaForCausalLM

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
    from transformers import AttentionInterface

    folded_steps = []

    def spy(module, query, key, value, mask, *a, **k):
        folded_steps.append(query.shape[2] == 1 and mask is not None)
        return gqa_decode_sdpa(module, query, key, value, mask, *a, **k)

    with torch.no_grad():
        plain = model.generate(**kw)
        with decode_attention(model):
            assert model.config._attn_implementation == NAME
            AttentionInterface.register(NAME, spy)
            folded = model.generate(**kw, cache_implementation="static")
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(folded, plain)
    assert sum(folded_steps) == 11 * cfg.num_hidden_layers  # every decoding step after the prefill, every layer
