"""The target architectures of issue 22 on CPU: GPT-OSS-20B (mixture of experts, alternating
sliding-window / full attention, 201,088-token vocabulary) and Llama-3.1-8B (dense, llama3 RoPE).

Pins:
- the shipped real configurations (``pkg:peagle_train/gpt-oss-20b.json``,
  ``llama-3.1-8b-instruct.json``) load through ``load_target_config`` -- no weights are built (20B and
  8B do not fit here), the checkpoint's MXFP4 ``quantization_config`` is not needed -- and the
  recipe's early checks pass against them (``recipes/gpt-oss-20b.yaml`` as is; for Llama the same
  recipe with the target and mask token swapped), with vLLM's default aux layers (2, L//2, L-3);
- the features the project captures from a tiny random-weight target of each architecture, built
  through ``load_target`` as every stage builds it, equal transformers' reference forward: ``aux``
  is the residual stream entering the aux layers (``hidden_states[i]``), ``last`` the final normed
  state, ``argmax`` the greedy next token, for a right-padded batch whose sequences are longer than
  the sliding window. The reference runs each sequence alone and unpadded; padding can only change
  pad positions (attention is causal and masked, MoE routing is per token), so the real positions
  are compared.
"""
from __future__ import annotations

import json

import pytest
import torch

from peagle_train.core.config import TargetConfig
from peagle_train.features.target import default_aux_layer_ids, load_target, load_target_config
from peagle_train.recipe import load_config, validate_against_target

RECIPE = "recipes/gpt-oss-20b.yaml"
RANDOM_TARGET = ["target.path=null", "target.name=random"]  # the recipe with a random-weight target instead


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("spec, overrides, shape", [
    ("gpt-oss-20b.json", [], dict(model_type="gpt_oss", num_hidden_layers=24, hidden_size=2880, vocab_size=201088,
                                  num_attention_heads=64, head_dim=64, num_key_value_heads=8, num_local_experts=32,
                                  num_experts_per_tok=4, intermediate_size=2880, sliding_window=128,
                                  tie_word_embeddings=False)),
    ("llama-3.1-8b-instruct.json", ["drafter.mask_token_id=128002"],  # <|reserved_special_token_0|>
     dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, vocab_size=128256, num_attention_heads=32,
          head_dim=128, num_key_value_heads=8, intermediate_size=14336, bos_token_id=128000,
          eos_token_id=[128001, 128008, 128009], tie_word_embeddings=False)),
], ids=["gpt-oss-20b", "llama-3.1-8b"])
def test_shipped_real_configs_load_and_pass_the_recipe_checks(spec, overrides, shape):
    cfg = load_config(RECIPE, [*RANDOM_TARGET, f"target.random_init_from_config=pkg:peagle_train/{spec}", *overrides])
    path, conf = load_target_config(cfg.target)
    assert {k: getattr(conf, k) for k in shape} == shape
    assert getattr(conf, "quantization_config", None) is None and not any(path.glob("*.safetensors"))
    L = conf.num_hidden_layers
    assert default_aux_layer_ids(L) == [2, L // 2, L - 3]
    validate_against_target(cfg, conf)
    if conf.model_type == "gpt_oss":
        assert conf.layer_types == ["sliding_attention", "full_attention"] * 12
        assert conf.rope_parameters["rope_type"] == "yarn" and conf.rope_parameters["factor"] == 32.0
        assert cfg.train.K == 10 and cfg.drafter.mask_token_id == 201020 < conf.vocab_size
    else:
        assert conf.rope_parameters["rope_type"] == "llama3" and conf.rope_parameters["factor"] == 8.0


TINY_GPT_OSS = {  # the GPT-OSS architecture at toy size: MoE, alternating sliding (window 8) / full attention
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": 2,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size": 128, "max_position_embeddings": 512,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 16,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "pad_token_id": 127, "eos_token_id": 126,
    "quantization_config": {"quant_method": "mxfp4"},  # as the real file has: dropped on load
}
TINY_LLAMA31 = {  # the Llama-3.1 shape pattern at toy size: GQA 4:1, llama3 RoPE scaling, untied head
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 224,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 128,
    "max_position_embeddings": 256, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": [1, 2, 3],
}


@pytest.mark.parametrize("tiny", [TINY_GPT_OSS, TINY_LLAMA31], ids=["gpt_oss_moe_sliding", "llama31_dense"])
def test_captured_features_equal_the_reference_forward(tiny, tmp_path):
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps({"_source": "test", **tiny}))
    aux_ids = [1, 2, 3]  # the defaults collide for 4 layers
    target = load_target(TargetConfig(name="tiny", random_init_from_config=str(spec), aux_layer_ids=aux_ids,
                                      dtype="float32", device="cpu"), with_tokenizer=False)
    model = target.model
    assert model.config.model_type == tiny["model_type"] and not model.config.tie_word_embeddings
    if tiny["model_type"] == "gpt_oss":
        assert model.config.sliding_window == 8 and model.config.layer_types[0] == "sliding_attention"
    head = target.lm_head_weight()
    assert head.shape == (128, 64) and head.data_ptr() != model.get_input_embeddings().weight.data_ptr()

    g = torch.Generator().manual_seed(0)
    lengths = [20, 13]  # both past the sliding window (8)
    ids = torch.full((2, max(lengths)), tiny.get("pad_token_id", 0), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(4, 120, (n,), generator=g)
        mask[b, :n] = 1
    feats = target.features(ids, mask)
    # right padding without a mask (what iter_target_features runs): the real positions' features are
    # the same (causal and sliding-window attention look back only; the MoE routes token by token)
    unmasked = target.features(ids, None)
    assert feats["aux"].shape == (2, 20, 3 * 64) and feats["last"].shape == (2, 20, 64)
    for b, n in enumerate(lengths):
        with torch.no_grad():
            ref = model(ids[b:b + 1, :n], output_hidden_states=True, use_cache=False)
        want_aux = torch.cat([ref.hidden_states[i][0] for i in aux_ids], dim=-1)
        torch.testing.assert_close(ref.logits[0], ref.hidden_states[-1][0] @ head.T, rtol=1e-4, atol=1e-4)
        for got in (feats, unmasked):
            torch.testing.assert_close(got["aux"][b, :n], want_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["last"][b, :n], ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
            assert torch.equal(got["argmax"][b, :n], ref.logits[0].argmax(-1))
    # the window is in force: the same weights with every layer full attention give the same residual
    # after layer 0 (sliding) within the first 8 positions, another one past them
    if tiny["model_type"] == "gpt_oss":
        full = load_target(TargetConfig(name="tiny", random_init_from_config=str(_no_window(spec)),
                                        aux_layer_ids=aux_ids, dtype="float32", device="cpu"), with_tokenizer=False)
        for (n, p), q in zip(model.named_parameters(), full.model.parameters()):
            assert torch.equal(p, q), n
        after0, full0 = feats["aux"][0, :, :64], full.features(ids[:1, :20])["aux"][0, :, :64]
        torch.testing.assert_close(after0[:8], full0[:8], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(after0[19], full0[19], atol=1e-3)


def _no_window(spec):
    """The same tiny GPT-OSS with every layer full attention (same seed, same weights)."""
    tree = json.loads(spec.read_text())
    tree["layer_types"] = ["full_attention"] * 4
    out = spec.with_name("full.json")
    out.write_text(json.dumps(tree))
    return out
