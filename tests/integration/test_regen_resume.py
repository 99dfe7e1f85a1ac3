"""A regeneration killed mid-shard resumes without duplicating or losing a conversation (issue 19).

A real ``peagle-train prepare`` subprocess (the real SmolLM2-135M target, a few short ShareGPT prompts,
shards of two conversations, the continuous-batching engine) is SIGKILLed while it generates its
second shard; a re-run finishes; its regenerated conversations and tokenised data are exactly those
of an uninterrupted run, each conversation once. Every process the test starts is ended in a
``finally`` block.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import need_smollm2

from peagle_train.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "smollm2-135m.yaml"
SMALL = ["data.num_conversations=7", "data.max_prompt_tokens=96", "data.eval_fraction=0.15", "regen.shard_size=2",
         "regen.max_new_tokens=24", "regen.batch_size=2", "regen.engine=continuous"]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _regenerated(out: Path, split: str) -> list:
    """The conversations of ``split``'s regeneration shards, in shard order."""
    shards = sorted((out / "data" / "regen").glob(f"{split}-*.json"))
    return [c for s in shards for c in json.loads(s.read_text())["conversations"]]


def test_prepare_killed_mid_shard_resumes_each_conversation_once(tmp_path):
    need_smollm2()
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(["prepare", str(RECIPE), f"output_dir={ref}", *SMALL, "--quiet"]) == 0  # uninterrupted
    n_train_shards = len(list((ref / "data" / "regen").glob("train-*.json")))
    assert n_train_shards >= 3

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "peagle_train.cli", "prepare", str(RECIPE), f"output_dir={run}",
                             *SMALL, "--quiet"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        first, second = run / "data" / "regen" / "train-00000.json", run / "data" / "regen" / "train-00001.json"
        deadline = time.monotonic() + 300
        while not first.exists():
            assert proc.poll() is None, f"prepare ended before its first shard: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "no shard written within 300 s"
            time.sleep(0.02)
        proc.kill()  # SIGKILL while the second shard is being generated
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -9
    assert not second.exists() and not (run / "data" / "meta.json").exists(), "the kill did not land mid-shard"
    assert len(_regenerated(run, "train")) == 2

    assert main(["prepare", str(RECIPE), f"output_dir={run}", *SMALL, "--quiet"]) == 0  # resumes
    for split in ("train", "eval"):
        got, want = _regenerated(run, split), _regenerated(ref, split)
        assert got == want
        firsts = [json.dumps(c[:2]) for c in got]  # system? + first user turn: one per source conversation
        assert len(set(firsts)) == len(firsts)
        assert (run / "data" / f"{split}.safetensors").read_bytes() == (ref / "data" / f"{split}.safetensors").read_bytes()
    meta, meta_ref = (json.loads((d / "data" / "meta.json").read_text()) for d in (run, ref))
    assert meta["splits"]["train"]["regeneration"]["engine"] == ["continuous"]
    for split in ("train", "eval"):
        a, b = meta["splits"][split], meta_ref["splits"][split]
        assert a["sequences"] == b["sequences"] and a["tokens"] == b["tokens"]
        assert a["regeneration"]["conversations_in"] == b["regeneration"]["conversations_in"]
        assert a["regeneration"]["unfinished_responses"] == b["regeneration"]["unfinished_responses"]
