"""Exports that could mislead a user (issue 21), on CPU with the tiny drafters of ``test_export``.

1. the export is held against its target (``export`` and ``check --target``), the speculators
   verifier records the target's architectures;
2. ``check --num-speculative-tokens K`` refuses K above the trained K; the card serves the trained K;
3. the card's serve command names the target's path / Hub id and the drafter's absolute path or
   Hub repo id, and says which;
4. the published card holds the dataset's name and counts, never a local path, home or token;
5. every export file is 0644, every folder 0755;
6. a folder that is not a drafter, a push without token or with a bad repo id: clear errors.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers import LlamaConfig

from peagle_train.cli import main
from peagle_train.core.config import ConfigError
from peagle_train.export.check import check_export
from peagle_train.export.hub import hub_readme, push_to_hub
from peagle_train.export.model_card import redact_local_paths
from peagle_train.export.writer import export_speculators, export_vllm, load_drafter_folder
from peagle_train.model.checkpoint import write_drafter_dir
from peagle_train.recipe import load_config
from tests.unit.test_export import AUX, FAKE_TOKEN, MASK, K, T, V, make_drafter, make_tokenizer, target_config

# an absolute path of this machine or a home folder: what a published file must never hold
LOCAL = re.compile(r"(?<![\w.:/~-])(/tmp|/root|/home|/Users|~)/")


def _assert_public(text: str, tmp_path: Path, what: str) -> None:
    home = os.path.expanduser("~")
    for needle in (str(tmp_path), home + "/", FAKE_TOKEN):
        assert needle not in text, f"{what} holds {needle!r}"
    m = LOCAL.search(text)
    assert m is None, f"{what} holds a local path: ...{text[max(0, m.start() - 40):m.end() + 40]}..."


def _target_dir(path: Path, **kw) -> Path:
    """A local target folder: config.json + tokenizer (all ``run_export`` reads of it)."""
    cfg = target_config()
    for k, v in kw.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(str(path))
    make_tokenizer().save_pretrained(str(path))
    return path


def _recipe(tmp_path: Path, target: Path, **export) -> Path:
    """A recipe YAML for a trained run under ``tmp_path/run`` (drafter folder written) with a local target."""
    data = tmp_path / "private" / "conversations.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("")
    rec = {"output_dir": str(tmp_path / "run"), "target": {"name": "tiny-target", "path": str(target)},
           "data": {"source": "jsonl", "path": str(data)},
           "drafter": {"num_layers": 2, "draft_vocab_size": 64, "mask_token_id": MASK},
           "train": {"K": K}, "eval": {"k_max": 2}, "export": {"dtype": "float32", **export}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    run = tmp_path / "run"
    d = make_drafter()
    write_drafter_dir(d.state_dict(), d.config, run / "drafter")
    (run / "data").mkdir(parents=True, exist_ok=True)
    meta = {"source": {"path": str(data), "conversations": 28, "duplicates_removed": 1, "user": "/home/alice"},
            "target": "tiny-target",
            "splits": {"train": {"sequences": 24, "tokens": 9000, "supervised_tokens": 4000, "median_length": 300,
                                 "regeneration": {"log": str(tmp_path / "run" / "data" / "regen")}}}}
    (run / "data" / "meta.json").write_text(json.dumps(meta))
    return path


def _run_export(recipe: Path):
    from peagle_train import stages

    cfg = load_config(recipe)
    return cfg, stages.run_export(cfg, progress=False)


def _serve_model(readme: str) -> dict:
    line = next(ln for ln in readme.splitlines() if ln.startswith("vllm serve "))
    return {"target": line.split()[2], **json.loads(line.split("'")[1])}


# --------------------------------------------------------------------------- 1. the target


def test_check_against_target_lists_every_mismatch(tmp_path, capsys):
    out = export_vllm(make_drafter(), tmp_path / "x", target_name="t", target_config=target_config())
    assert check_export(out, target=_target_dir(tmp_path / "same")) == []
    bad = tmp_path / "other"
    LlamaConfig(hidden_size=48, num_hidden_layers=5, num_attention_heads=4, vocab_size=256, bos_token_id=7,
                eos_token_id=8).save_pretrained(str(bad))
    problems = check_export(out, target=bad / "config.json")
    text = "\n".join(problems)
    assert "eagle_aux_hidden_state_layer_ids [1, 4, 5] has [5] outside the target's num_hidden_layers = 5" in text
    assert f"target_hidden_size={T} but the target config has 48 (hidden_size)" in text
    assert f"vocab_size={V} but the target config has 256" in text
    assert "bos_token_id=1 but the target config has 7" in text and "eos_token_id=2 but the target config has 8" in text
    assert main(["check", str(out), "--target", str(bad)]) == 1
    printed = capsys.readouterr().out
    assert printed.count("FAIL ") == 5 and "5 problem(s)" in printed
    assert main(["check", str(out), "--target", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_export_stage_checks_the_recipe_target(tmp_path, capsys):
    recipe = _recipe(tmp_path, _target_dir(tmp_path / "tgt", num_hidden_layers=5))  # aux id 5 is not a layer
    with pytest.raises(ConfigError, match=r"\[5\] outside the target's num_hidden_layers = 5"):
        _run_export(recipe)
    assert not (tmp_path / "run" / "export").exists()
    assert main(["export", str(recipe), "--quiet"]) == 2
    assert "num_hidden_layers = 5" in capsys.readouterr().err


def test_speculators_export_records_the_target_architectures(tmp_path):
    recipe = _recipe(tmp_path, _target_dir(tmp_path / "tgt"), speculators_format=True, verifier="tiny-org/target")
    _run_export(recipe)
    cfg = json.loads((tmp_path / "run" / "export-speculators" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "tiny-org/target",
                                                     "architectures": ["LlamaForCausalLM"]}
    assert cfg["transformer_layer_config"]["eos_token_id"] == 2
    spec_readme = (tmp_path / "run" / "export-speculators" / "README.md").read_text()
    assert _serve_model(spec_readme)["model"] == str((tmp_path / "run" / "export-speculators").absolute())


# --------------------------------------------------------------------------- 2. served K


def test_check_refuses_served_k_above_trained_k(tmp_path, capsys):
    out = export_vllm(make_drafter(), tmp_path / "p", target_name="t")
    assert check_export(out, num_speculative_tokens=K) == []
    (problem,) = check_export(out, num_speculative_tokens=K + 1)
    assert f"num_speculative_tokens = {K + 1} exceeds the trained K (num_parallel_depths) = {K}" in problem
    assert main(["check", str(out), "--num-speculative-tokens", str(K + 1)]) == 1
    assert "exceeds the trained K" in capsys.readouterr().out
    assert main(["check", str(out), "--num-speculative-tokens", str(K)]) == 0
    eagle3 = export_vllm(make_drafter(parallel=False), tmp_path / "e", target_name="t")
    assert check_export(eagle3, num_speculative_tokens=10) == []  # autoregressive: any K
    spec = export_speculators(make_drafter(), tmp_path / "s", target_name="t", verifier_name_or_path="o/t")
    assert len(check_export(spec, num_speculative_tokens=K + 1)) == 1
    # the card serves the trained K
    cfg = json.loads((out / "config.json").read_text())
    assert _serve_model((out / "README.md").read_text())["num_speculative_tokens"] == cfg["num_parallel_depths"] == K


# --------------------------------------------------------------------------- 3. the serve command


def test_card_serve_command_names_real_paths_and_says_which(tmp_path, monkeypatch, capsys):
    target = _target_dir(tmp_path / "tgt")
    monkeypatch.chdir(tmp_path)
    out = export_vllm(make_drafter(), Path("rel-export"), target_name="SmolLM2 display name",
                      card={"serve_target": str(target)})
    readme = (out / "README.md").read_text()
    serve = _serve_model(readme)
    assert serve["target"] == str(target) and serve["model"] == str(tmp_path / "rel-export")
    assert Path(serve["model"]).is_absolute()
    assert f"`model` is this export's absolute local path `{tmp_path / 'rel-export'}`" in readme
    assert f"The target `{target}` is a local model directory" in readme
    # the pushed card: the Hub repo id, and a target to fill in (only a local folder was known)
    pushed = hub_readme(out, "me/tiny-peagle")
    serve = _serve_model(pushed)
    assert serve["model"] == "me/tiny-peagle" and serve["target"] == "<TARGET_HUB_ID_OR_PATH>"
    assert "`model` is the drafter's Hub repo id `me/tiny-peagle`" in pushed
    assert "Replace `<TARGET_HUB_ID_OR_PATH>` with the Hub id or a local directory of the target SmolLM2" in pushed


def test_run_export_card_uses_recipe_target_and_absolute_export(tmp_path):
    from peagle_train import stages
    from peagle_train.export.model_card import render_model_card

    target = _target_dir(tmp_path / "tgt")
    cfg, path = _run_export(_recipe(tmp_path, target, verifier="tiny-org/target"))
    serve = _serve_model((path / "README.md").read_text())
    assert serve["target"] == str(target) and serve["model"] == str(path) == str((tmp_path / "run" / "export"))
    # the eval stage re-renders the card with model_ref="export": the card's paths still win
    readme = render_model_card(json.loads((path / "config.json").read_text()), target_name=cfg.target.name,
                               model_ref="export", card=stages._card(cfg))
    assert _serve_model(readme)["model"] == str(path)
    # a Hub target (or the verifier id) is what the pushed card serves
    assert _serve_model(hub_readme(path, "me/x"))["target"] == "tiny-org/target"


# --------------------------------------------------------------------------- 4. nothing local is published


def test_published_card_and_files_hold_no_local_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    _cfg, path = _run_export(_recipe(tmp_path, _target_dir(tmp_path / "tgt")))
    readme = (path / "README.md").read_text()
    assert "conversations.jsonl (local file)" in readme and "`dataset`: jsonl: conversations.jsonl" in readme
    assert '"sequences": 24' in readme and '"conversations": 28' in readme
    assert "/home/alice" not in readme and str(tmp_path / "private") not in readme
    files = push_to_hub(path, "me/tiny-peagle", dry_run=True)
    assert ".peagle-card.json" not in files and "README.md" in files
    for name in files:
        if name.endswith(".safetensors"):
            continue
        text = hub_readme(path, "me/tiny-peagle") if name == "README.md" else (path / name).read_text()
        _assert_public(text, tmp_path, name)
    _assert_public(capsys.readouterr().out, tmp_path, "the dry run's output")


def test_redaction_keeps_urls_and_prose():
    text = ("see https://huggingface.co/me/x and vllm/transformers_utils; H / T = 1/2; /root/x, ~/data/y, "
            f"C:\\Users\\bob\\f.json, {FAKE_TOKEN}")
    out = redact_local_paths(text)
    assert "https://huggingface.co/me/x" in out and "vllm/transformers_utils" in out and "H / T = 1/2" in out
    assert "/root" not in out and "~/data" not in out and "bob" not in out and FAKE_TOKEN not in out


# --------------------------------------------------------------------------- 5. file modes


def test_export_files_are_world_readable(tmp_path):
    old = os.umask(0o022)
    try:
        for out in (export_vllm(make_drafter(), tmp_path / "v", target_name="t", tokenizer=make_tokenizer()),
                    export_speculators(make_drafter(), tmp_path / "s", target_name="t", verifier_name_or_path="o/t")):
            assert out.stat().st_mode & 0o777 == 0o755
            for p in out.rglob("*"):
                assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p.name
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- 6. clear errors


def _model_folder(path: Path) -> Path:
    """A plain target model folder (config.json + weights), not a drafter."""
    target_config().save_pretrained(str(path))
    save_file({"lm_head.weight": torch.zeros(V, T)}, str(path / "model.safetensors"))
    return path


def test_check_and_export_of_a_folder_that_is_not_a_drafter(tmp_path, capsys):
    folder = _model_folder(tmp_path / "smollm2")
    (problem,) = check_export(folder)
    assert "not a drafter folder of peagle_train" in problem and "target_hidden_size" in problem
    assert main(["check", str(folder)]) == 1
    assert "not a drafter folder" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="not a drafter folder.*draft_vocab_size"):
        load_drafter_folder(folder)
    recipe = _recipe(tmp_path, _target_dir(tmp_path / "tgt"))
    drafter_dir = tmp_path / "run" / "drafter"
    for p in drafter_dir.iterdir():
        p.unlink()
    _model_folder(drafter_dir)
    assert main(["export", str(recipe), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not a drafter folder" in err and "Traceback" not in err


def test_push_errors_are_clear_and_never_show_the_token(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    out = export_vllm(make_drafter(), tmp_path / "x", target_name="t")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["push", str(out), "me/x"]) == 2
    assert "HF_TOKEN is not set" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    for bad in ("no-owner", "me/bad name", "a/b/c", "me/-x-"):
        assert main(["push", str(out), bad]) == 2, bad
        cap = capsys.readouterr()
        assert "owner/name" in cap.err and FAKE_TOKEN not in cap.out + cap.err

    def refuse(self, repo_id, **kw):
        raise RuntimeError(f"401 for token {self.token}")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refuse)
    assert main(["push", str(out), "me/x"]) == 2
    cap = capsys.readouterr()
    assert "the Hub refused the upload to me/x" in cap.err and FAKE_TOKEN not in cap.out + cap.err
