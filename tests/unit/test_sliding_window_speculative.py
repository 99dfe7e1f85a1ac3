"""The reference speculative-decoding loop on a target with sliding-window attention (GPT-OSS).

transformers' ``DynamicCache`` keeps only the last ``sliding_window - 1`` keys of a sliding layer and
refuses to ``crop`` it once the window is full unless it records past states; the loop crops rejected
drafts after every verification, so it failed on GPT-OSS (``RuntimeError: crop was called ... sliding
window size was already reached``). Pins: on a tiny random GPT-OSS (MoE, alternating sliding window 8 /
full attention, sinks) greedy speculative decoding of prompts longer than the window equals the target
alone for K = 1..4, through rounds with full, partial and no acceptance.
"""
from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from peagle_train.decoding.speculative import speculative_generate, target_generate
from peagle_train.features.target import Target
from peagle_train.model.drafter import Drafter, make_drafter_config
from test_speculative import _biased as _bias  # the same biased-head helper

AUX = [1, 2, 3]
C = 5  # the token the target and one drafter favour
TINY_GPT_OSS = dict(  # the GPT-OSS architecture at toy size (as tests/unit/test_target_architectures.py)
    hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2, vocab_size=64, max_position_embeddings=256,
    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 16,
                  "rope_type": "yarn", "truncate": False},
    rope_theta=150000, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False, pad_token_id=63,
    eos_token_id=62)


def test_greedy_speculative_equals_target_past_the_sliding_window():
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_oss", attn_implementation="eager", **TINY_GPT_OSS)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    assert model.config.layer_types[0] == "sliding_attention" and model.config.sliding_window == 8
    with torch.no_grad():  # C is the argmax at about half of the contexts: multi-token acceptances happen
        lg = model(input_ids=torch.randint(0, 62, (1, 64))).logits[0]
    model.lm_head = _bias(model.lm_head, C, float((lg.max(-1).values - lg[:, C]).quantile(0.5)))
    target = Target(model=model, tokenizer=None, aux_layer_ids=AUX, path="")
    dcfg = make_drafter_config(model.config, aux_layer_ids=AUX, draft_vocab_size=64, mask_token_id=63, K=4,
                               num_layers=1, parallel_drafting=True)
    drafters = []
    for seed, bias in ((1, 3.0), (2, 0.0)):
        torch.manual_seed(seed)
        d = Drafter(dcfg).eval().requires_grad_(False)
        d.reset_parameters(0.2)
        if bias:
            d.lm_head = _bias(d.lm_head, C, bias)
        drafters.append(d)
    hist = collections.Counter()
    prompt = torch.randint(0, 62, (20,), generator=torch.Generator().manual_seed(3)).tolist()  # > window
    ref, _ = target_generate(target, prompt, 24)
    assert len(ref) == 24
    for K in range(1, 5):
        for d in drafters:
            out, stats = speculative_generate(target, d, prompt, K, 24)
            assert out == ref, f"K={K}: speculative output diverges from the target's greedy output"
            hist.update(("none" if a == 0 else "all" if a == K else "some") for a in stats.accepted)
    assert hist["none"] > 0 and hist["some"] > 0 and hist["all"] > 0, hist


def test_verification_after_a_long_prefill_equals_the_full_forward():
    """The loop's cache keeps every key (no ``DynamicSlidingWindowLayer``: transformers 5.17 returned all
    recorded keys against a window-sized mask, a shape error at the first verification on GPT-OSS-20B) and
    the sliding window is still applied by the mask: a prefill longer than the window, then a verification
    of 4 tokens and a crop of 2 of them, then 3 more tokens give the logits of one forward over the whole
    sequence without a cache (float32: the experts' grouped matmul has no float64 kernel)."""
    from peagle_train.decoding.target_runner import TargetRunner

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_oss", attn_implementation="eager", **TINY_GPT_OSS)
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    target = Target(model=model, tokenizer=None, aux_layer_ids=AUX, path="")
    ids = torch.randint(0, 62, (30,), generator=torch.Generator().manual_seed(4))  # window 8: 3 windows long
    runner = TargetRunner(target)
    runner.start(30)
    assert not any(getattr(layer, "is_sliding", False) for layer in getattr(runner._cache, "layers", []))
    pre, _ = runner.forward(ids[:20], want_aux=False, prefill=True)
    ver, _ = runner.forward(ids[20:24], want_aux=False)  # no crop after the prefill
    runner.drop(2)  # two rejected drafts: ids[22:24] leave the cache
    tail, _ = runner.forward(ids[22:25], want_aux=False)
    assert runner.length == 25
    with pytest.raises(ValueError, match="sliding-window targets"):
        TargetRunner(target, static=True)  # a static cache would keep only the window: refused
    full = model(input_ids=ids[None, :25]).logits[0]
    torch.testing.assert_close(pre, full[:20], rtol=0, atol=1e-5)
    torch.testing.assert_close(ver, full[20:24], rtol=0, atol=1e-5)
    torch.testing.assert_close(tail, full[22:25], rtol=0, atol=1e-5)
    window_blind = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_oss", attn_implementation="eager", **{**TINY_GPT_OSS, "sliding_window": 64})).eval()
    window_blind.load_state_dict(model.state_dict())
    assert not torch.allclose(window_blind(input_ids=ids[None, :25]).logits[0][20:], full[20:25])  # window matters
