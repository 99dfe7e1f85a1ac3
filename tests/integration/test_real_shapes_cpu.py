"""The production recipes (``recipes/gpt-oss-20b.yaml``, ``recipes/llama-3.1-8b.yaml``) run their whole
pipeline on CPU against a TINY random-weight target of the same architecture, through overrides only.

Per architecture, one ``peagle-train run`` (prepare with regeneration by the target, cache, train on the
cache, export, eval) and one ``peagle-train train`` with ``train.features=online`` on the same prepared
data. Inputs are the ones the real runs use, shrunk: the real chat template and special token ids with
the real vocabulary size (the stand-in tokenizer, ``target.tokenizer=stand-in:...``), the offline
ShareGPT prompts (``data.source=sharegpt``), the shipped MT-Bench questions, and a target configuration
of the same model type and layer pattern (``pkg:peagle_train/*-tiny.json``: GPT-OSS keeps mixture of
experts, alternating sliding-window / full attention and attention sinks; Llama-3.1 is dense).

Pins: every stage completes and leaves its output; the export passes ``peagle-train check``; the eval
loop runs and is lossless (greedy speculative decoding equals the target alone, across GPT-OSS's sliding
window); the model card and the eval report say RANDOM WEIGHTS; the mask token of the recipe is a
valid, special id of the stand-in tokenizer. Acceptance numbers are meaningless here (random weights).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from peagle_train.cli import main

ROOT = Path(__file__).resolve().parents[2]

#: recipe, tiny target configuration, stand-in tokenizer
ARCHES = {
    "gpt-oss-20b": ("recipes/gpt-oss-20b.yaml", "pkg:peagle_train/gpt-oss-20b-tiny.json", "stand-in:gpt-oss"),
    "llama-3.1-8b": ("recipes/llama-3.1-8b.yaml", "pkg:peagle_train/llama-3.1-8b-tiny.json", "stand-in:llama-3.1"),
}

#: CPU sizes: a few ShareGPT prompts, 8 regenerated tokens, 1 epoch, K = 3, one MT-Bench question
TINY = [
    "target.path=null", "target.dtype=float32", "target.device=cpu", "target.attn_implementation=eager",
    "target.feature_attn_implementation=null",  # the GPT-OSS recipe's flex_attention applies the sinks on CUDA only
    "data.source=sharegpt", "data.num_conversations=7", "data.max_prompt_tokens=512", "data.max_length=640",
    "data.eval_fraction=0.25",
    "regen.max_new_tokens=8", "regen.batch_size=8",
    "drafter.draft_vocab_size=1024",
    "train.K=3", "train.epochs=1", "train.max_steps=3", "train.partitions=1", "train.mixed_precision='no'",
    "train.activation_checkpointing=false", "train.global_batch_size=null", "train.report_to=[]",
    "train.eval_sequences=1", "train.eval_every=null", "train.save_every=null",
    "eval.datasets=[mt_bench]", "eval.num_prompts=1", "eval.max_new_tokens=6", "eval.k_max=3", "eval.both_turns=false",
]


def _overrides(arch: str, out: Path) -> list[str]:
    recipe, config, tokenizer = ARCHES[arch]
    return [str(ROOT / recipe), f"output_dir={out}", f"target.random_init_from_config={config}",
            f"target.tokenizer={tokenizer}", *TINY]


@pytest.fixture(scope="module", params=sorted(ARCHES))
def finished(request, tmp_path_factory):
    """``(arch, run_dir, online_dir, seconds)``: the cached run and the online training, once per architecture."""
    arch = request.param
    base = tmp_path_factory.mktemp(arch)
    mp = pytest.MonkeyPatch()
    mp.setenv("PEAGLE_CACHE", str(base / "cache"))
    try:
        t0 = time.perf_counter()
        run, online = base / "run", base / "online"
        args = _overrides(arch, run)
        assert main(["run", *args[:1], *args[1:], "train.features=cache", "--quiet"]) == 0
        shutil.copytree(run / "data", online / "data")  # the same prepared data, trained online
        assert main(["train", *_overrides(arch, online), "train.features=online", "--quiet"]) == 0
        yield arch, run, online, time.perf_counter() - t0
    finally:
        mp.undo()


def test_every_stage_completes_and_the_export_passes_check(finished):
    arch, run, online, seconds = finished
    meta = json.loads((run / "data" / "meta.json").read_text())
    regen = meta["splits"]["train"]["regeneration"]
    assert meta["splits"]["train"]["sequences"] >= 2 and regen["generated_tokens"] > 0
    manifest = json.loads((run / "features" / "train" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards"]
    for d in (run, online):
        metrics = json.loads((d / "train_metrics.json").read_text())
        assert metrics["steps"] >= 1 and all(h["loss"] == h["loss"] for h in metrics["history"])  # finite
    assert not (online / "features").exists()  # online: no feature cache was written
    assert main(["check", str(run / "export")]) == 0
    conf = json.loads((run / "export" / "config.json").read_text())
    assert conf["parallel_drafting"] is True and conf["draft_vocab_size"] == 1024
    target = json.loads(next((run.parent / "cache" / "targets").glob("random-*/config.json")).read_text())
    assert target["vocab_size"] == (201088 if arch == "gpt-oss-20b" else 128256)
    if arch == "gpt-oss-20b":  # the architecture's features, at toy size: MoE, alternating sliding/full layers
        assert target["num_local_experts"] > target["num_experts_per_tok"] > 1
        assert target["layer_types"][:2] == ["sliding_attention", "full_attention"]
    ev = json.loads((run / "eval" / "eval.json").read_text())
    assert "acceptance_length" in json.dumps(ev)
    assert "PASSED" in (run / "eval" / "eval.md").read_text()  # lossless: greedy speculative == target alone
    print(f"{arch}: whole pipeline + online training in {seconds:.1f} s")


def test_reports_say_random_weights(finished):
    arch, run, _, _ = finished
    card = (run / "export" / "README.md").read_text()
    assert "Random-weight target" in card and "Do not serve it" in card
    assert "RANDOM WEIGHTS" in (run / "eval" / "eval.md").read_text()


def test_mask_token_and_special_ids_are_the_real_ones(finished):
    """The recipe's mask token is a special id of the stand-in tokenizer (201020 for GPT-OSS: a reserved
    Harmony slot; 128002 for Llama-3.1: <|reserved_special_token_0|>), the exported ptd token is it, and the
    template's markers are single tokens at their real ids."""
    from transformers import AutoTokenizer

    from peagle_train.core.config import TargetConfig
    from peagle_train.features.target import tokenizer_source

    arch, run, _, _ = finished
    conf = json.loads((run / "export" / "config.json").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEAGLE_CACHE", str(run.parent / "cache"))
        tok = AutoTokenizer.from_pretrained(tokenizer_source(
            TargetConfig(name="t", random_init_from_config="x", tokenizer=ARCHES[arch][2]), None))
    if arch == "gpt-oss-20b":
        assert len(tok) == 201088 and conf["ptd_token_id"] == 201020
        want = {"<|return|>": 200002, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
                "<|message|>": 200008}
    else:
        assert len(tok) == 128256 and conf["ptd_token_id"] == 128002
        want = {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
                "<|eot_id|>": 128009}
    assert tok.added_tokens_decoder[conf["ptd_token_id"]].special  # a reserved special token, never in chat text
    for text, i in want.items():
        assert tok(text, add_special_tokens=False)["input_ids"] == [i], text
