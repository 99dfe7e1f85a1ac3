"""Every recipe in recipes/ loads and validates; dotted overrides are typed; the CLI's stage list is frozen."""
from pathlib import Path

import pytest

from peagle_train.cli import STAGES, build_parser
from peagle_train.core.config import ConfigError
from peagle_train.recipe import load_config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"


def test_there_are_recipes():
    assert any(p.name == "smollm2-135m.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    cfg = load_config(path)
    assert cfg.source_file == str(path)
    if cfg.train.method == "peagle":
        assert cfg.eval.k_max <= cfg.train.K
        assert cfg.drafter.mask_token_id is not None


def test_overrides_are_typed_and_checked():
    cfg = load_config(DEFAULT, ["train.lr=3e-4", "train.partitions=4", "eval.datasets=[mt_bench, humaneval]"])
    assert cfg.train.lr == 3e-4 and cfg.train.partitions == 4 and cfg.eval.datasets == ["mt_bench", "humaneval"]
    with pytest.raises(ConfigError, match=r"train\.partitions"):
        load_config(DEFAULT, ["train.partitions=zero"])
    with pytest.raises(ConfigError, match="override 'train.lr'"):
        load_config(DEFAULT, ["train.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("recipes/does-not-exist.yaml")


def test_cli_surface_is_frozen():
    assert STAGES == ("prepare", "cache", "train", "export", "eval", "run")
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted([*STAGES, "check", "push"])


def test_heldout_needs_enough_training_eval_sequences():
    with pytest.raises(ConfigError, match="eval_walk_al_heldout would cover fewer prompts"):
        load_config(DEFAULT, ["eval.datasets=[heldout]", "eval.num_prompts=50", "train.eval_sequences=8"])
    cfg = load_config(DEFAULT, ["eval.datasets=[heldout]", "eval.num_prompts=4", "train.eval_sequences=8"])
    assert cfg.eval.datasets == ["heldout"]


def test_errors_suggest_keys_and_name_command_line_overrides():
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key \(misspelled\? did you mean 'lr'\?\) "
                                          r"\[from the command line: train\.lrr=1\]"):
        load_config(DEFAULT, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"train\.K: .*integer.*\[from the command line: train\.K=abc\]"):
        load_config(DEFAULT, ["train.K=abc"])
    # a union field reports under a longer location (train.compile.bool): still named as the override
    with pytest.raises(ConfigError, match=r"train\.compile\.bool: .*\[from the command line: train\.compile=fastest\]"):
        load_config(DEFAULT, ["train.compile=fastest"])
    with pytest.raises(ConfigError, match=r"trian: unknown key \(misspelled\? did you mean 'train'\?\)"):
        load_config(DEFAULT, ["trian.lr=1"])
