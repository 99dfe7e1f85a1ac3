"""``target.random_init_from_config``: a target of a real model's shape with random weights.

Pins: exactly one target source; the shipped configurations resolve (``pkg:peagle_train/…``) and a
missing one is named with the choices; the same seed gives the same weights in every stage (two
loads), another seed other weights; the folder is marked as random weights and holds no weights; a
stage that tokenises without ``target.tokenizer`` gets a clear error; the config carries the
shipped file's values (the ``_source`` note is dropped).
"""
import json

import pytest
import torch

from peagle_train.core.config import TargetConfig
from peagle_train.features.target import (
    TargetLoadError,
    is_random_target,
    load_target,
    load_target_config,
    random_config_file,
)

SMOL = "pkg:peagle_train/smollm2-135m-instruct.json"


@pytest.fixture()
def tiny_config(tmp_path, monkeypatch):
    """A tiny Llama configuration JSON (with a ``_source`` note, as the shipped files have) and an empty cache."""
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    cfg = {"_source": "test", "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
           "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
           "vocab_size": 96, "max_position_embeddings": 128, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_exactly_one_target_source():
    with pytest.raises(ValueError, match="exactly one of target.path"):
        TargetConfig(name="t", path="x", random_init_from_config=SMOL)
    with pytest.raises(ValueError, match="exactly one of target.path"):
        TargetConfig(name="t")
    assert TargetConfig(name="t", random_init_from_config=SMOL).path is None


def test_shipped_configuration_resolves_and_a_missing_one_is_named():
    assert json.loads(random_config_file(SMOL).read_text())["hidden_size"] == 576
    with pytest.raises(TargetLoadError, match=r"nope\.json.*pkg:peagle_train/smollm2-135m-instruct\.json"):
        random_config_file("pkg:peagle_train/nope.json")


def test_same_seed_same_weights_other_seed_other_weights(tiny_config):
    cfg = TargetConfig(name="tiny", random_init_from_config=str(tiny_config), device="cpu")
    path, conf = load_target_config(cfg)
    assert is_random_target(path) and conf.num_hidden_layers == 8 and not hasattr(conf, "_source")
    assert not any(path.glob("*.safetensors"))  # no weights on disk: drawn at load
    a = load_target(cfg, with_tokenizer=False)
    b = load_target(cfg, with_tokenizer=False)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    c = load_target(cfg.model_copy(update={"random_init_seed": 1}), with_tokenizer=False)
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    assert a.aux_layer_ids == [2, 4, 5]


def test_a_stage_that_tokenises_needs_target_tokenizer(tiny_config):
    cfg = TargetConfig(name="tiny", random_init_from_config=str(tiny_config), device="cpu")
    with pytest.raises(TargetLoadError, match="set target.tokenizer"):
        load_target(cfg)


def test_model_card_and_eval_report_say_random_weights(tmp_path):
    """A run on a random-weight target says so: the card built from the run (``stages._card``) carries the
    configuration's name (never a local path) and the rendered card opens with the warning."""
    from peagle_train.export.model_card import render_model_card
    from peagle_train.recipe import config_from_dict
    from peagle_train.stages import _card

    local = tmp_path / "secret" / "cfg.json"
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"),
                            "target": {"name": "tiny", "random_init_from_config": str(local)},
                            "drafter": {"num_layers": 1, "mask_token_id": 5}})
    card = _card(cfg)
    assert card["random_weights"] == "cfg.json"
    config = {"parallel_drafting": True, "num_parallel_depths": 4, "ptd_token_id": 5, "num_hidden_layers": 1,
              "architectures": ["LlamaForCausalLMEagle3"]}
    text = render_model_card(config, target_name="tiny", model_ref="/abs/export", card={"random_weights": "cfg.json"})
    assert "Random-weight target" in text and "Do not serve it" in text and str(local) not in text
    plain = render_model_card(config, target_name="tiny", model_ref="/abs/export")
    assert "Random-weight" not in plain


def test_a_missing_tokenizer_is_named_by_its_key(tiny_config, tmp_path):
    """``target.tokenizer`` pointing nowhere: the error names the key and the path, not the target folder."""
    cfg = TargetConfig(name="tiny", random_init_from_config=str(tiny_config), device="cpu",
                       tokenizer=str(tmp_path / "no_tokenizer_here"))
    with pytest.raises(TargetLoadError, match=r"target\.tokenizer '.*no_tokenizer_here'"):
        load_target(cfg)
