"""Regeneration by a GPT-OSS target keeps its Harmony channels (issue 22): the HF engine splits a generated
turn on the special ids into the ``analysis`` reasoning and the ``final`` answer (``data_prep.rounds.
harmony_splitter``), so ``data.supervise_reasoning`` learns the reasoning and the GPT-OSS template renders
the turn back verbatim; a turn cut inside its reasoning is ended as ``unfinished_reasoning``. Uses the
stand-in GPT-OSS tokenizer (real vocabulary size, special ids and chat template)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from data_prep.config import RegenConfig
from data_prep.rounds import harmony_splitter, run_rounds
from data_prep.template import tokenize_conversation
from peagle_train.features.stand_in_tokenizer import build_stand_in_tokenizer

TURN = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_stand_in_tokenizer("gpt-oss", tmp_path_factory.mktemp("tok") / "t"))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_harmony_turns_split_into_reasoning_and_answer(tok, tmp_path):
    split = harmony_splitter(tok)
    assert split(_ids(tok, TURN)) == ("User asks 2+2. Easy.", "4")
    assert split(_ids(tok, "<|channel|>analysis<|message|>User asks 2+")) == ("User asks 2+", "")  # cut by the cap
    assert split(_ids(tok, "<|channel|>final<|message|>Hi there")) == (None, "Hi there")  # cut in the answer
    two = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>" \
          "<|start|>assistant<|channel|>final<|message|>c<|return|>"
    assert split(_ids(tok, two)) == ("a\n\nb", "c")
    assert split(_ids(tok, "no channels at all<|return|>")) is None  # not Harmony: the engine decodes it plainly
    llama = AutoTokenizer.from_pretrained(build_stand_in_tokenizer("llama-3.1", tmp_path / "llama"))
    assert harmony_splitter(llama) is None  # no Harmony template: plain decoding


class _Model:
    """Just what hf_engine reads of a model, with plain generate's output replaced by fixed turns."""
    device = torch.device("cpu")
    _supports_attention_backend = False

    def __init__(self, eos):
        self.generation_config = type("G", (), {"eos_token_id": eos})()

    def eval(self):
        return self


def test_regenerated_gpt_oss_turns_keep_reasoning_and_render_verbatim(tok, monkeypatch):
    import data_prep.regenerate as R

    turns = {0: _ids(tok, TURN), 1: _ids(tok, "<|channel|>analysis<|message|>Let me think about the")}
    monkeypatch.setattr(R, "_generate_batch", lambda model, prompts, pad, eos, kw, bucket=1, *refill: [
        (turns[0], True) if len(p) == min(map(len, prompts)) else (turns[1], False) for p in prompts])
    complete, engine = R.hf_engine(_Model([tok.convert_tokens_to_ids("<|return|>")]), tok,
                                   RegenConfig(engine="generate", batch_size=2, max_new_tokens=16))
    assert engine == "generate"
    convs = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "old"}],
             [{"role": "user", "content": "A much longer question about something?"},
              {"role": "assistant", "content": "old"}]]
    out, report = run_rounds(complete, tok, convs, 512, progress=False)
    assert out == [[{"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4", "reasoning": "User asks 2+2. Easy."}]]
    assert report["counts"]["unfinished_reasoning"] == 1
    row = tokenize_conversation(tok, out[0], 1024, "truncate", supervise_reasoning=True)
    text = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "User asks 2+2. Easy." in text and text.rstrip().endswith("4<|return|>")  # reasoning and answer learned
