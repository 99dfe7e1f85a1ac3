"""Stand-in tokenizers (``peagle_train/features/stand_in_tokenizer.py``, ``target.tokenizer=stand-in:<kind>``).

Pins: exactly the real vocabulary size (GPT-OSS 201,088; Llama-3.1 128,256); the real special tokens at
their real ids, each one token when the chat template writes it; the recipes' mask tokens (201020,
128002) are reserved special ids; the real chat template (its file names its source and licence)
renders a conversation that tokenises and decodes back verbatim, Harmony channels included; every id a
random target can emit decodes; Llama prepends <|begin_of_text|> like the real tokenizer; the builder
is deterministic; a wrong kind is named with the choices, through the recipe key too.
"""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from peagle_train.core.config import TargetConfig
from peagle_train.features.stand_in_tokenizer import TEMPLATES, build_stand_in_tokenizer, main
from peagle_train.features.target import TargetLoadError, tokenizer_source

REAL = {
    "gpt-oss": (201088, 201020, {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                                 "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                                 "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}),
    "llama-3.1": (128256, 128002, {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                                   "<|reserved_special_token_0|>": 128002, "<|start_header_id|>": 128006,
                                   "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
                                   "<|python_tag|>": 128010, "<|reserved_special_token_247|>": 128255}),
}


@pytest.fixture(scope="module", params=sorted(REAL))
def built(request, tmp_path_factory):
    kind = request.param
    out = build_stand_in_tokenizer(kind, tmp_path_factory.mktemp(kind) / "tok")
    return kind, out, AutoTokenizer.from_pretrained(out)


def test_vocabulary_size_and_special_ids_are_the_real_ones(built):
    kind, _, tok = built
    size, mask, named = REAL[kind]
    assert len(tok) == size and max(tok.get_vocab().values()) == size - 1
    for text, i in named.items():
        assert tok.convert_tokens_to_ids(text) == i and tok(text, add_special_tokens=False)["input_ids"] == [i]
    assert tok.added_tokens_decoder[mask].special


def test_real_chat_template_round_trips(built):
    kind, out, tok = built
    header = (TEMPLATES / ("gpt-oss.jinja" if kind == "gpt-oss" else "llama-3.1.jinja")).read_text()[:600]
    assert "Source: https://" in header and "Licence:" in header
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va? 2+2"},
            {"role": "assistant", "content": "Oui: 4.", "thinking": "add them"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    if kind == "gpt-oss":  # Harmony: developer message, analysis channel of the last turn, <|return|>
        assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
        assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>add them<|end|>"
                             "<|start|>assistant<|channel|>final<|message|>Oui: 4.<|return|>")
        assert tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True).endswith(
            "<|start|>assistant")
        assert tok.eos_token_id == 200002 and tok.pad_token_id == 199999
    else:
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge")
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nOui: 4.<|eot_id|>")
        assert tok("hi")["input_ids"] == [128000, ord("h"), ord("i")]  # BOS prepended as the real one does
        assert tok.eos_token_id == 128009


def test_every_id_decodes_and_the_builder_is_deterministic(built, tmp_path):
    kind, out, tok = built
    size = REAL[kind][0]
    assert isinstance(tok.decode(list(range(0, size, 997)) + [size - 1]), str)
    again = build_stand_in_tokenizer(kind, tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_unknown_kind_is_named(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"'qwen'.*gpt-oss.*llama-3\.1"):
        build_stand_in_tokenizer("qwen", tmp_path)
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    cfg = TargetConfig(name="t", random_init_from_config="x.json", tokenizer="stand-in:qwen")
    with pytest.raises(TargetLoadError, match=r"target\.tokenizer 'stand-in:qwen'.*stand-in:gpt-oss"):
        tokenizer_source(cfg, None)
    with pytest.raises(SystemExit):
        main(["qwen", str(tmp_path / "x")])


def test_recipe_key_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    cfg = TargetConfig(name="t", random_init_from_config="x.json", tokenizer="stand-in:llama-3.1")
    first = tokenizer_source(cfg, None)
    assert first == str(tmp_path / "cache" / "tokenizers" / "stand-in-llama-3.1")
    stamp = (tmp_path / "cache" / "tokenizers" / "stand-in-llama-3.1" / "tokenizer.json").stat().st_mtime_ns
    assert tokenizer_source(cfg, None) == first
    assert (tmp_path / "cache" / "tokenizers" / "stand-in-llama-3.1" / "tokenizer.json").stat().st_mtime_ns == stamp


def test_a_refused_attention_implementation_names_the_key(tmp_path, monkeypatch):
    """``target.attn_implementation`` reaches transformers; a value it refuses is named by its key."""
    import json

    from peagle_train.features.target import load_target

    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    spec = tmp_path / "c.json"
    spec.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
                                "vocab_size": 96}))
    base = TargetConfig(name="t", random_init_from_config=str(spec), device="cpu")
    assert load_target(base.model_copy(update={"attn_implementation": "eager"}),
                       with_tokenizer=False).model.config._attn_implementation == "eager"
    with pytest.raises(TargetLoadError, match=r"target\.attn_implementation 'no_such_kernel'"):
        load_target(base.model_copy(update={"attn_implementation": "no_such_kernel"}), with_tokenizer=False)
