"""data_prep.code_prompts: code requests from a tree of Python files, and the committed standard-library set
(recipes/data/stdlib_code_prompts.json.gz; runs 10 and 11 trained on it, docs/results.md)."""
from __future__ import annotations

import gzip
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from data_prep.code_prompts import INSTRUCTIONS, chat_rows, function_prompts, main, tree_prompts, write_rows
from data_prep.config import DataConfig
from data_prep.eval_prompts import HUMANEVAL_INSTRUCTION, load_eval_prompts
from data_prep.sharegpt import DataError
from data_prep.sources import load_conversations

COMMITTED = Path(__file__).resolve().parents[2] / "recipes" / "data" / "stdlib_code_prompts.json.gz"

SOURCE = '''
import os


def commonprefix(m):
    "Given a list of pathnames, returns the longest common leading component"
    if not m:
        return ''
    return os.path.commonprefix(m)


@staticmethod
def scaled(x: float, factor: float = 2.0) -> float:
    """Return x multiplied by factor, the factor defaulting to two."""
    return x * factor


async def fetch(url):
    """Fetch the resource at url and return its body as bytes."""
    return await get(url)


def _private(x):
    """A private helper is not a public function and is left out."""
    return x


def short(x):
    """Too short."""
    return x


def only_doc(x):
    """A function whose body is its docstring alone has nothing to write."""


class Stack:
    """A stack."""

    def push(self, item):
        """Put item on the top of the stack and return the new size."""
        self.items.append(item)
        return len(self.items)

    def _grow(self):
        """Private methods are left out as well, whatever their docstring."""
        pass


class _Hidden:
    def visible(self):
        """A method of a private class is left out with its class."""
        return 1
'''


def test_function_prompts_takes_documented_public_functions_and_methods_in_source_order():
    got = function_prompts(SOURCE, "pkg.mod")
    assert [p.origin for p in got] == ["pkg.mod:commonprefix", "pkg.mod:scaled", "pkg.mod:fetch", "pkg.mod:Stack.push"]
    assert got[0].stub == ("def commonprefix(m):\n"
                           "    \"\"\"Given a list of pathnames, returns the longest common leading component\"\"\"")
    assert got[1].stub.startswith("def scaled(x: float, factor: float=2.0) -> float:\n")  # decorator dropped
    assert got[2].stub.startswith("async def fetch(url):")
    assert got[3].stub == ("class Stack:\n    def push(self, item):\n"
                           "        \"\"\"Put item on the top of the stack and return the new size.\"\"\"")
    assert "return len(self.items)" in got[3].reference and got[1].reference.startswith("@staticmethod")
    assert function_prompts("def broken(:\n", "x") == []  # a file that does not parse gives nothing
    assert [p.origin for p in function_prompts(SOURCE, "m", min_doc_chars=70)] == ["m:commonprefix"]


def test_tree_prompts_skips_tests_and_excluded_folders_and_keeps_a_repeated_stub_once(tmp_path):
    one = "def area(w, h):\n    \"\"\"Return the area of a w by h rectangle, in square units.\"\"\"\n    return w * h\n"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "geo.py").write_text(one)
    (tmp_path / "a.py").write_text(one)  # the same stub again: kept once, from the first file in path order
    for skipped in ("test/t.py", "idlelib/i.py", "pkg/tests/u.py", "test_x.py"):
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_text(one.replace("area", Path(skipped).stem + "_area"))
    got = tree_prompts(tmp_path)
    assert [p.origin for p in got] == ["a:area"]
    with pytest.raises(FileNotFoundError, match="not a directory"):
        tree_prompts(tmp_path / "missing")


def test_rows_rotate_the_instructions_are_written_atomically_and_read_by_both_sources(tmp_path):
    """A ``.json.gz`` name gives a JSON array (the ``sharegpt`` source's streaming reader takes it, no ``datasets``),
    a ``.jsonl.gz`` name JSON lines (the ``jsonl`` source): the same conversations either way."""
    prompts = function_prompts(SOURCE, "m")
    rows = chat_rows(prompts)
    assert [r["messages"][0]["content"].split("\n")[0] for r in rows] == list(INSTRUCTIONS)
    assert rows[0]["messages"][0]["content"] == f"{INSTRUCTIONS[0]}\n```python\n{prompts[0].stub}\n```"
    assert rows[3]["messages"][1] == {"role": "assistant", "content": f"```python\n{prompts[3].reference}\n```"}
    want = sorted(r["messages"][0]["content"] for r in rows)
    for name, source in (("code.json.gz", "sharegpt"), ("code.jsonl.gz", "jsonl"), ("code.json", "sharegpt")):
        out = tmp_path / name
        write_rows(rows, out)
        first = out.read_bytes()
        write_rows(rows, out)  # the same rows give the same bytes (gzip timestamp 0)
        assert out.read_bytes() == first
        convs, rep = load_conversations(DataConfig(source=source, path=str(out), num_conversations=10))
        assert rep["kept"] == 4 and sorted(c[0]["content"] for c in convs) == want, name
    assert json.loads(gzip.decompress((tmp_path / "code.json.gz").read_bytes())) == rows
    blob = (tmp_path / "code.json.gz").read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(blob[: len(blob) // 2])  # a .gz cut short: named, not a traceback
    with pytest.raises(DataError, match=r"cut.json.gz: not a readable gzip file .*gzip -t"):
        load_conversations(DataConfig(source="sharegpt", path=str(tmp_path / "cut.json.gz")))
    (tmp_path / "cut.json.gz").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.json", "code.json.gz", "code.jsonl.gz"]  # no temp left


def test_a_stub_holding_a_markdown_fence_gets_a_longer_one():
    src = 'def show(x):\n    """Return x as markdown: ```python\\nx\\n``` with its fences kept."""\n    return x\n'
    (row,) = chat_rows(function_prompts(src, "m"))
    user = row["messages"][0]["content"]
    assert user.split("\n")[1] == "````python" and user.endswith("\n````")
    assert row["messages"][1]["content"].startswith("````python\n")


def test_the_committed_set_is_what_the_builder_makes_and_no_row_overlaps_an_evaluation_prompt(tmp_path):
    """The committed code set: 3,051 rows with distinct functions, every row a user request and a reference
    answer; the decontamination screen against MT-Bench and HumanEval drops none of them (and would drop a
    HumanEval problem written as such a row); none uses the evaluation's EvalPlus wrapper; rebuilt from this interpreter's standard library it is byte-identical where the
    interpreter is the one it was built with (CPython 3.11.7)."""
    from data_prep.decontaminate import eval_overlap_screen

    rows = json.loads(gzip.decompress(COMMITTED.read_bytes()))
    assert len(rows) == 3051 and len({r["origin"] for r in rows}) == 3051
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    _, rep = load_conversations(DataConfig(source="sharegpt", path=str(COMMITTED), num_conversations=100000),
                                    eval_overlap_screen(["mt_bench", "humaneval"]))
    assert rep["kept"] == 3051 and rep["eval_overlap"] == {}
    assert not any(HUMANEVAL_INSTRUCTION in r["messages"][0]["content"] for r in rows)  # not the eval's wrapper
    problem = load_eval_prompts("humaneval", 1)[0][0].split("```python\n")[1]  # a HumanEval problem as a code row
    wrapped = dict(rows[0], messages=[{"role": "user", "content": f"{INSTRUCTIONS[0]}\n```python\n{problem}"},
                                      rows[0]["messages"][1]])
    write_rows([wrapped], tmp_path / "evalplus.jsonl")  # is screened out, as the set's rows would be
    with pytest.raises(DataError, match=r"evalplus.jsonl: no usable .* overlapping evaluation prompts \(humaneval 1.*"
                                        r"overlaps an evaluation set: take other conversations"):
        load_conversations(DataConfig(source="jsonl", path=str(tmp_path / "evalplus.jsonl")),
                           eval_overlap_screen(["humaneval"]))
    if sys.version_info[:3] != (3, 11, 7) or sys.implementation.name != "cpython":
        pytest.skip(f"the committed set was built on CPython 3.11.7's standard library, this is {sys.version.split()[0]}")
    main([str(tmp_path / "again.json.gz"), "--root", sysconfig.get_paths()["stdlib"]])
    assert (tmp_path / "again.json.gz").read_bytes() == COMMITTED.read_bytes()
