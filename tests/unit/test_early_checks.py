"""Impossible recipe/target combinations fail before any work (issue 21).

``validate_against_target`` (peagle_train/recipe.py) checks everything about the drafter's shape
that the target's config decides; ``prepare`` runs it on the target's config alone, before loading
weights, tokenizer or data, so a bad ``drafter.*`` value is a ConfigError naming the recipe file,
the key and the fix (CLI exit 2) instead of a traceback in ``train``.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import conv, save_tiny_target
from transformers import LlamaConfig

from peagle_train.cli import main
from peagle_train.core.config import ConfigError, DrafterConfig, TargetConfig
from peagle_train.recipe import RunConfig, load_config, validate_against_target

# the tiny target of conftest.save_tiny_target: hidden 32, 4 query / 2 KV heads (head_dim 8), vocab 64, 6 layers
TARGET = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)


def recipe(aux=(1, 2, 3), **drafter) -> RunConfig:
    return RunConfig(target=TargetConfig(name="tiny", path="unused", aux_layer_ids=list(aux) if aux else None),
                     drafter=DrafterConfig(**{"mask_token_id": 5, **drafter}), source_file="r.yaml")


@pytest.mark.parametrize("cfg", [
    recipe(),
    recipe(hidden_size=32, num_attention_heads=8, head_dim=4),
    recipe(hidden_size=16, allow_hidden_size_mismatch=True),  # the opt-in
    recipe(hidden_size=48, allow_hidden_size_mismatch=True, num_attention_heads=6, num_key_value_heads=3,
           head_dim=6, draft_vocab_size=64),
    recipe(init_layers="target", num_layers=6),
], ids=["defaults", "other_heads", "h_ne_t_opted_in", "own_heads", "init_layers_target"])
def test_fitting_recipes_pass(cfg):
    """Accepted shapes build the drafter as training does (same resolution of null fields)."""
    from peagle_train.model.drafter import Drafter, make_drafter_config

    validate_against_target(cfg, TARGET)
    dcfg = make_drafter_config(TARGET, aux_layer_ids=[1, 2, 3], draft_vocab_size=64, mask_token_id=5,
                               **cfg.drafter.shape_fields())
    Drafter(dcfg)


@pytest.mark.parametrize("cfg, match", [
    (recipe(hidden_size=512), r"^r\.yaml: drafter\.hidden_size=512 differs from the target's hidden size 32 \(tiny\); "
                              r"set drafter\.hidden_size: null \(or 32\).*drafter\.allow_hidden_size_mismatch: true"),
    (recipe(num_attention_heads=6, num_key_value_heads=3),
     r"^r\.yaml: drafter\.hidden_size=32 \(the target's; drafter\.hidden_size is null\) is not a multiple of "
     r"drafter\.num_attention_heads=6.*choose drafter\.num_attention_heads dividing it"),
    (recipe(num_attention_heads=1), r"^r\.yaml: drafter\.num_attention_heads=1 is not a multiple of "
                                    r"drafter\.num_key_value_heads=2 \(the target's; drafter\.num_key_value_heads is "
                                    r"null\).*set drafter\.num_key_value_heads to a divisor"),
    (recipe(num_key_value_heads=3), r"drafter\.num_attention_heads=4 \(the target's.*not a multiple of "
                                    r"drafter\.num_key_value_heads=3"),
    (recipe(num_key_value_heads=8), r"not a multiple of drafter\.num_key_value_heads=8"),
    (recipe(head_dim=7), r"^r\.yaml: drafter\.head_dim=7 is odd.*set drafter\.head_dim to an even number"),
    (recipe(draft_vocab_size=65), r"^r\.yaml: drafter\.draft_vocab_size=65 exceeds the target vocab 64"),
    (recipe(mask_token_id=64), r"^r\.yaml: drafter\.mask_token_id=64 is outside the target vocab \[0, 64\)"),
    (recipe(aux=(1, 2, 6)), r"^r\.yaml: target\.aux_layer_ids=\[1, 2, 6\] must be < the target's 6 layers"),
    (recipe(aux=None), r"^r\.yaml: target\.aux_layer_ids is null: a 6-layer target has colliding default aux layers"),
    (recipe(init_layers="target", intermediate_size=48),
     r"^r\.yaml: drafter\.init_layers: target .*same layer shape: drafter\.intermediate_size=48 but the target's is 64"),
    (recipe(init_layers="target", num_attention_heads=8, head_dim=4),
     r"same layer shape: drafter\.num_attention_heads=8 but the target's is 4.*drafter\.init_layers: random"),
    (recipe(init_layers="target", num_layers=7), r"drafter\.num_layers=7 exceeds the target's 6 layers"),
], ids=["hidden_size", "hidden_vs_heads", "heads_vs_target_kv", "target_heads_vs_kv", "more_kv_than_q", "odd_head_dim",
        "draft_vocab", "mask_token", "aux_ids", "default_aux_collide", "init_target_mlp", "init_target_heads",
        "init_target_layers"])
def test_impossible_drafter_shapes_are_config_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        validate_against_target(cfg, TARGET)


def test_init_layers_target_refuses_a_mixture_of_experts_target():
    """GPT-OSS-style targets have no dense layers to start from (their ``mlp`` is a router and experts)."""
    moe = LlamaConfig(**{**TARGET.to_dict(), "num_local_experts": 32})
    with pytest.raises(ConfigError, match="mixtures of 32 experts, not dense Llama layers"):
        validate_against_target(recipe(init_layers="target"), moe)
    validate_against_target(recipe(), moe)  # random layers: fine


def test_zero_sizes_are_refused_at_load():
    """0 would silently mean "copy the target's" (``x or target``): refused by the recipe schema."""
    with pytest.raises(Exception, match="drafter.head_dim"):
        RunConfig.model_validate({"target": {"name": "t", "path": "p"}, "drafter": {"head_dim": 0}})


@pytest.fixture()
def tiny_run(tmp_path):
    """A recipe file for the tiny random target (no tokenizer: prepare could not get past loading it)."""
    save_tiny_target(tmp_path / "target")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conv(f"q{i}", f"a{i}")}) + "\n" for i in range(8)))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"),
        "target": {"name": "tiny", "path": str(tmp_path / "target"), "aux_layer_ids": [1, 2, 3], "device": "cpu"},
        "data": {"source": "jsonl", "path": str(data)},
        "regen": {"enabled": False},
        "drafter": {"mask_token_id": 5},
    }))
    return path, tmp_path / "run"


def _no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("prepare loaded the target before checking the recipe against its config")

    monkeypatch.setattr("peagle_train.features.target.load_target", refuse)
    monkeypatch.setattr("data_prep.sources.load_conversations", refuse)


def test_prepare_refuses_hidden_size_mismatch_before_any_work(tiny_run, monkeypatch):
    from peagle_train import stages

    path, out = tiny_run
    _no_weights(monkeypatch)
    cfg = load_config(path, ["drafter.hidden_size=512"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: drafter\.hidden_size=512 differs .*"
                                          r"allow_hidden_size_mismatch"):
        stages.run_prepare(cfg, progress=False)
    assert not (out / "data").exists()


def test_cli_prepare_exits_2_with_the_key_and_the_fix(tiny_run, capsys, monkeypatch):
    path, out = tiny_run
    _no_weights(monkeypatch)
    assert main(["prepare", str(path), "drafter.hidden_size=512", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: drafter.hidden_size=512 differs from the target's hidden size 32" in err
    assert "drafter.allow_hidden_size_mismatch: true" in err and "Traceback" not in err
    assert not (out / "data").exists() or not any((out / "data").iterdir())
