"""Qwen3-style reasoning through HF regeneration (project issue 21).

The HF engine decodes a turn with its ``<think>…</think>`` block; ``data_prep.rounds`` splits it
with the markers of the target's own template into the message's ``reasoning`` and its answer
``content``, so ``tokenize_conversation`` renders it with the template's reasoning handling:
multi-turn conversations tokenise (Qwen3 drops the reasoning of turns before the last user
message) and ``supervise_reasoning`` applies. The model is scripted (``ScriptedModel``: fixed
responses per user message) so the real Qwen3 tokenizer and template run without weights.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import conv
from test_templates import FIX, masked_texts, qwen3  # noqa: F401  (qwen3: the real Qwen3 tokenizer fixture)

from data_prep.config import RegenConfig
from data_prep.regenerate import _decoder, regenerate
from data_prep.rounds import Completion, reasoning_markers, run_rounds, split_reasoning
from data_prep.template import tokenize_conversation

THINK = ("<think>", "</think>")


# --------------------------------------------------------------------------- split_reasoning


@pytest.mark.parametrize("text, expected", [
    ("Plain answer.", (None, "Plain answer.", True)),
    ("<think>\nR1\nR2\n</think>\n\nThe answer.", ("R1\nR2", "The answer.", True)),
    ("<think>\n\n</think>\n\nA", ("", "A", True)),  # the empty block of a non-thinking turn
    ("R only\n</think>\n\nA", ("R only", "A", True)),  # generation prompt already ended with <think>
    ("<think>\na</think>b\n</think>\n\nA", ("a</think>b", "A", True)),  # answer after the last end marker
    ("<think>\nLet me count: 1, 2,", ("Let me count: 1, 2,", "", False)),  # cut inside the reasoning
    ("<think>\n", ("", "", False)),
    ("<think>\nR\n</think>\n\n", ("R", "", True)),  # reasoning, no answer
])
def test_split_reasoning(text, expected):
    assert split_reasoning(text, THINK) == expected


def test_reasoning_markers_come_from_the_template(qwen3):
    assert reasoning_markers(qwen3) == THINK
    for name in ("llama3_instruct_chat_template.jinja", "gpt_oss_messages_chat_template.jinja"):
        assert reasoning_markers(SimpleNamespace(chat_template=(FIX / name).read_text())) is None
    seed = SimpleNamespace(chat_template={"default": "{{ '<seed:think>' + r + '</seed:think>' }}"})
    assert reasoning_markers(seed) == ("<seed:think>", "</seed:think>")
    assert reasoning_markers(SimpleNamespace(chat_template=None)) is None


# --------------------------------------------------------------------------- HF regeneration, real Qwen3


class ScriptedModel:
    """Stands in for a HF causal LM: ``generate`` appends, to each left-padded prompt, the tokens of
    ``script[last user message]`` (cut at ``max_new_tokens``) and records the prompts it saw."""

    device = "cpu"

    def __init__(self, tok, script: dict[str, str]):
        self.tok, self.script, self.prompts = tok, script, []
        self.generation_config = SimpleNamespace(eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, pad_token_id, eos_token_id, max_new_tokens, do_sample):
        import torch

        rows = []
        for ids, keep in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tok.decode([t for t, k in zip(ids, keep) if k])
            self.prompts.append(prompt)
            user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            rows.append(ids + self.tok(self.script[user], add_special_tokens=False)["input_ids"][:max_new_tokens])
        width = max(map(len, rows))
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])  # (B, L + T_new)


SCRIPT = {
    "Is 7 prime?": "<think>\n7 has no divisor between 2 and 6.\n</think>\n\nYes, 7 is prime.<|im_end|>",
    "And 9?": "<think>\n9 = 3 * 3.\n</think>\n\nNo: 9 = 3 × 3.<|im_end|>",
    "And 11?": "<think>\nNo divisor up to 3.\n</think>\n\nYes, 11 is prime.<|im_end|>",
    "Hi": "<think>\n\n</think>\n\nHello!<|im_end|>",
    "Count to 100.": "<think>\nThe user wants every number, let me write them one by one: 1 2 3 4 5 6 7 8 9 10"
                     " 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25.\n</think>\n\n1, 2, 3, …<|im_end|>",
}
CONVS = [
    conv("Is 7 prime?", "old", "And 9?", "old", "And 11?", "old"),
    conv("Hi", "old", "Count to 100.", "old"),  # turn 2 is cut inside its reasoning: the conversation keeps turn 1
    conv("Count to 100.", "old"),  # cut inside the reasoning at turn 1: dropped
]


@pytest.fixture(scope="module")
def regenerated(qwen3):
    model = ScriptedModel(qwen3, SCRIPT)
    out, rep = regenerate(model, qwen3, CONVS, RegenConfig(max_new_tokens=40, batch_size=2), 4096, progress=False)
    return model, out, rep


def test_hf_regeneration_splits_reasoning_into_its_field(regenerated):
    model, out, rep = regenerated
    assert [m for m in out[0] if m["role"] == "assistant"] == [
        {"role": "assistant", "content": "Yes, 7 is prime.", "reasoning": "7 has no divisor between 2 and 6."},
        {"role": "assistant", "content": "No: 9 = 3 × 3.", "reasoning": "9 = 3 * 3."},
        {"role": "assistant", "content": "Yes, 11 is prime.", "reasoning": "No divisor up to 3."},
    ]
    assert out[1] == conv("Hi", "Hello!")  # an empty think block: no reasoning field
    assert len(out) == 2
    assert rep["unfinished_reasoning"] == 2 and rep["unfinished_responses"] == 2 and rep["empty_responses"] == 0
    assert rep["conversations_dropped"] == 1 and rep["conversations_cut"] == 1 and rep["turns_generated"] == 4
    # the history sent back holds the answers, never the reasoning
    later = [p for p in model.prompts if "And 11?" in p]
    assert len(later) == 1 and "Yes, 7 is prime." in later[0] and "no divisor" not in later[0].lower()


@pytest.mark.parametrize("supervise_reasoning", [True, False])
def test_multi_turn_regenerated_reasoning_tokenises_with_exact_masks(qwen3, regenerated, supervise_reasoning):
    """Fails before the split: the content held ``<think>…</think>``, which Qwen3 drops from earlier turns
    (``TemplateError: assistant message 1: … does not render its content verbatim``)."""
    _, out, _ = regenerated
    report: dict = {}
    tok = tokenize_conversation(qwen3, out[0], 4096, "drop", supervise_reasoning=supervise_reasoning, report=report)
    last = SCRIPT["And 11?"] if supervise_reasoning else "Yes, 11 is prime.<|im_end|>"
    # Qwen3 renders only the reasoning of turns after the last user message: here the last turn's
    assert masked_texts(qwen3, tok) == ["Yes, 7 is prime.<|im_end|>", "No: 9 = 3 × 3.<|im_end|>", last]
    assert report == {"reasoning_dropped_by_template": 2}
    # the ids are the template's own render of the split messages
    expected = qwen3.apply_chat_template(
        [{"role": m["role"], "content": m["content"], **({"reasoning_content": m["reasoning"]} if "reasoning" in m
                                                         else {})} for m in out[0]], tokenize=True)["input_ids"]
    assert tok["input_ids"] == list(expected)


def test_engine_reasoning_with_no_answer_when_cut_is_not_kept(qwen3):
    """An engine that separates the reasoning (a vLLM reasoning parser) and is cut before the answer."""
    answers = {0: Completion("", "half a thought", 8, False), 1: Completion("", "done thinking", 8, True)}
    out, stats = run_rounds(lambda jobs: [(i, answers[j[0]]) for i, j in enumerate(jobs)], qwen3,
                            [conv("a"), conv("b")], 4096, progress=False)
    assert out == [] and stats["counts"]["unfinished_reasoning"] == 1 and stats["counts"]["empty_responses"] == 1


def test_decoder_keeps_reasoning_markers_that_are_special_tokens(qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3.name_or_path)
    tok.chat_template = qwen3.chat_template
    ids = tok("<think>\nR\n</think>\n\nA<|im_end|>", add_special_tokens=False)["input_ids"]
    assert _decoder(tok)(ids) == "<think>\nR\n</think>\n\nA"
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert tok.decode(ids, skip_special_tokens=True).strip() == "R\n\n\nA"  # what a plain decode would lose
    assert _decoder(tok)(ids) == "<think>\nR\n</think>\n\nA"
