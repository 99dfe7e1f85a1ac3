"""A run folder's stamp (``run_config.yaml``) across recipe-schema versions (issue 21).

A key added to the recipe after a folder was stamped (``data.fold_system_into_user``) is no recipe
change while it keeps its default: the folder, even one holding a finished run, is reused. Set to
another value it is a change and refused like any other.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from peagle_train.core.config import ConfigError
from peagle_train.recipe import load_config
from peagle_train.stages import claim_output_dir, stamp_differences

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"


def _old_stamp(out: Path, *missing: str) -> None:
    """Rewrite ``out``'s stamp as a version of the recipe schema without the keys ``missing`` wrote it."""
    stamp = yaml.safe_load((out / "run_config.yaml").read_text())
    for key in missing:
        section, name = key.split(".")
        del stamp[section][name]
    (out / "run_config.yaml").write_text(yaml.safe_dump(stamp, sort_keys=False))


def test_key_newer_than_the_stamp_at_its_default_reuses_the_folder(tmp_path):
    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg())
    (out / "train_metrics.json").write_text("{}")  # a finished run: every identity change is refused
    _old_stamp(out, "data.fold_system_into_user", "train.max_skipped_steps")
    assert claim_output_dir(cfg()) == out  # the same recipe: reused
    assert stamp_differences(cfg(), yaml.safe_load((out / "run_config.yaml").read_text())) == []
    with pytest.raises(ConfigError, match=r"differs in: data\.fold_system_into_user\)"):
        claim_output_dir(cfg("data.fold_system_into_user=true"))
    with pytest.raises(ConfigError, match=r"differs in: train\.lr\)"):  # other keys still count
        claim_output_dir(cfg("train.lr=1e-3"))
    assert (out / "train_metrics.json").exists()


def test_portable_state_and_profiling_keys_are_not_the_runs_identity(tmp_path):
    """Each launch names its own portable-state files (docs/resume.md) and may profile: a folder with
    training output, relaunched with other ``train.state_*`` or ``train.profile_*`` values, is reused."""
    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg("train.state_out=a.pst"))
    (out / "train_metrics.json").write_text("{}")
    assert claim_output_dir(cfg("train.state_in=a.pst", "train.state_out=b.pst", "train.state_moments=fp32",
                                "train.state_part_mib=16", "train.profile_steps=3", "train.profile_start=5")) == out
    with pytest.raises(ConfigError, match=r"differs in: train\.lr\)"):
        claim_output_dir(cfg("train.state_out=a.pst", "train.lr=1e-3"))


def test_the_targets_attention_kernel_may_change_between_stages(tmp_path):
    """``target.attn_implementation`` says which kernel computes the target's attention, not what is computed: a
    folder with prepared data (regenerated on the default kernel) or a trained drafter takes a recipe that only
    switches it (the real-shape script's feature forwards on flex_attention), for every stage, and the stamp keeps
    what made the folder; the same folder still refuses a change of what is computed."""
    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg())
    (out / "data").mkdir()
    (out / "data" / "meta.json").write_text("{}")  # prepared
    before = (out / "run_config.yaml").read_text()
    assert claim_output_dir(cfg("target.attn_implementation=flex_attention")) == out
    (out / "drafter").mkdir()  # trained
    assert claim_output_dir(cfg("target.attn_implementation=eager")) == out
    assert claim_output_dir(cfg("target.feature_attn_implementation=flex_attention")) == out
    assert (out / "run_config.yaml").read_text() == before
    with pytest.raises(ConfigError, match=r"differs in: target\.dtype\)"):
        claim_output_dir(cfg("target.attn_implementation=eager", "target.dtype=bfloat16"))


def test_eval_may_run_the_target_otherwise_in_a_finished_run(tmp_path):
    """Eval of a trained run with the target in another dtype or device (the real-shape script evals a
    random-weight target in float32, docs/real_shapes.md) is no recipe change for eval, leaves the stamp as it
    was, and is still refused for training; a change to anything else is refused for eval too."""
    from peagle_train.stages import EVAL_RUNTIME_KEYS

    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg())
    (out / "drafter").mkdir()  # trained
    before = (out / "run_config.yaml").read_text()
    runtime = ("target.dtype=bfloat16", "target.device=cpu")
    assert claim_output_dir(cfg(*runtime), runtime_keys=EVAL_RUNTIME_KEYS) == out
    assert (out / "run_config.yaml").read_text() == before
    with pytest.raises(ConfigError, match=r"differs in: target\.dtype\)"):
        claim_output_dir(cfg("target.dtype=bfloat16"))  # not for training
    with pytest.raises(ConfigError, match=r"differs in: train\.lr\)"):
        claim_output_dir(cfg("target.dtype=bfloat16", "train.lr=1e-3"), runtime_keys=EVAL_RUNTIME_KEYS)


def test_shards_per_call_is_not_the_runs_identity(tmp_path):
    """``regen.shards_per_call`` says how many shards one engine run answers, not what they hold: a folder stamped
    before the key existed, or with another value, takes the recipe (a half-done prepare resumes with any value)."""
    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg())
    (out / "train_metrics.json").write_text("{}")
    _old_stamp(out, "regen.shards_per_call")
    assert claim_output_dir(cfg("regen.shards_per_call=3")) == out
    assert claim_output_dir(cfg("regen.shards_per_call=2")) == out
    with pytest.raises(ConfigError, match=r"differs in: regen\.shard_size\)"):  # the shards themselves still count
        claim_output_dir(cfg("regen.shard_size=7"))


def test_keep_kv_is_not_the_runs_identity(tmp_path):
    """``regen.keep_kv`` (and its ``keep_kv_frames``) says how the segmented engine builds each call's cache, not
    which tokens it answers: a folder stamped without it, or with the other value, takes the recipe, while a change
    to what is generated (``regen.max_new_tokens``) is still refused."""
    out = tmp_path / "run"
    seg = ("regen.engine=static", "regen.segment_tokens=16")
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *seg, *o])  # noqa: E731
    claim_output_dir(cfg())
    (out / "train_metrics.json").write_text("{}")
    _old_stamp(out, "regen.keep_kv")
    assert claim_output_dir(cfg("regen.keep_kv=true")) == out
    assert claim_output_dir(cfg("regen.keep_kv=true", "regen.keep_kv_frames=0.5")) == out
    assert claim_output_dir(cfg("regen.keep_kv=false")) == out
    with pytest.raises(ConfigError, match=r"differs in: regen\.max_new_tokens\)"):
        claim_output_dir(cfg("regen.keep_kv=true", "regen.max_new_tokens=7"))
