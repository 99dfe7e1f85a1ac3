"""Evaluation prompts never enter training (``data.decontaminate``, ``data_prep/decontaminate.py``):
the 13-word overlap rule on planted cases, the source loader skipping and counting them while still
meeting ``num_conversations``, and a check BY CONTENT, with another method (normalised substrings),
that no MT-Bench or HumanEval prompt is left in the ShareGPT conversations a recipe would train on."""
from __future__ import annotations

import json
import re

import pytest

from data_prep.config import DataConfig
from data_prep.decontaminate import NGRAM, EvalOverlap, eval_overlap_screen, words
from data_prep.eval_prompts import load_eval_prompts
from data_prep.sources import load_conversations

HAWAII = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
          "and must-see attractions.")


def _conv(user: str, answer: str = "ok") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_overlap_rule_on_planted_cases():
    screen = EvalOverlap({"mt_bench": [[HAWAII, "Rewrite your previous response."]], "other": [["a b c"]]})
    assert len(words(HAWAII)) >= NGRAM
    # pasted into a longer message, re-cased and re-wrapped: 13 words in a row survive
    assert screen(_conv("please help:\n" + HAWAII.lower().replace(" a recent", "\na   recent") + " thanks")) == "mt_bench"
    assert screen(_conv("Write a blog post about Hawaii and its culture.")) is None  # a paraphrase
    assert screen(_conv("rewrite your previous response.")) == "mt_bench"  # a short prompt: equal words
    assert screen(_conv("Rewrite your previous response, please.")) is None  # short and not equal
    assert screen(_conv("hello", HAWAII)) is None  # assistant turns are not screened
    assert screen([{"role": "system", "content": HAWAII}, *_conv("hi")]) is None
    assert screen(_conv("hi") + _conv("A B C")) == "other"  # any user turn
    with pytest.raises(ValueError, match="n=0"):
        EvalOverlap({}, n=0)


def test_humaneval_instruction_alone_is_no_overlap():
    screen = eval_overlap_screen(["humaneval", "heldout"])
    assert screen.sizes == {"humaneval": 164}  # heldout is the recipe's own split: nothing to load
    he = load_eval_prompts("humaneval", 1)[0][0]
    body = he.split("```python\n", 1)[1].rstrip("`\n")
    assert screen(_conv("Please provide a self-contained Python script that solves the following problem in a "
                        "markdown code block: print the primes below 100")) is None
    assert screen(_conv("Can you fix this?\n" + body)) == "humaneval"
    assert eval_overlap_screen(["heldout"]) is None


def test_loader_skips_and_counts_overlaps_and_still_fills_the_selection(tmp_path):
    rows = [{"messages": _conv(f"question number {i} about the weather", f"answer {i}")} for i in range(6)]
    rows.insert(2, {"messages": _conv("Hi! " + HAWAII)})
    rows.insert(5, {"messages": _conv("take a moment to evaluate and critique your own response.")})  # a short one
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source="jsonl", path=str(path), num_conversations=6, max_turns=1)
    screen = EvalOverlap({"mt_bench": load_eval_prompts("mt_bench", 80)})
    convs, report = load_conversations(cfg, screen)
    assert len(convs) == 6 and all("weather" in c[0]["content"] for c in convs)
    assert report["eval_overlap"] == {"mt_bench": 2} and report["decontaminated_against"] == ["mt_bench"]
    assert len(report["eval_overlap_example_rows"]) == 2
    _, plain = load_conversations(cfg)
    assert plain["eval_overlap"] == {} and plain["decontaminated_against"] == []


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def test_no_eval_prompt_is_left_in_the_training_source_by_content():
    """The first 3,000 ShareGPT conversations as a recipe loads them with data.decontaminate: no user turn
    contains any MT-Bench question or HumanEval problem (its first 120 characters, whitespace and case
    normalised: a check independent of the 13-word rule)."""
    cfg = DataConfig(source="sharegpt", num_conversations=3000, max_turns=8)
    convs, report = load_conversations(cfg, eval_overlap_screen(["mt_bench", "humaneval"]))
    assert report["decontaminated_against"] == ["humaneval", "mt_bench"]
    needles = [_norm(t)[:120] for p in load_eval_prompts("mt_bench", 80) for t in p if len(_norm(t)) >= 60]
    needles += [_norm(p[0].split("```python\n", 1)[1])[:120] for p in load_eval_prompts("humaneval", 164)]
    users = [_norm(m["content"]) for c in convs for m in c if m["role"] == "user"]
    leaks = [(n[:50], u[:80]) for n in needles for u in users if n in u]
    assert not leaks, leaks[:3]
