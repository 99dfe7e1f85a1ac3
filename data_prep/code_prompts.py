"""Code prompts from Python source: one chat conversation per documented public function.

A drafter learns the target's answers to the prompts it is trained on. ShareGPT holds few code requests
(a quarter of its conversations contain code, mostly inside prose), so a drafter trained on it alone drafts
code answers worst (HumanEval, docs/results.md). This builder turns every documented public function of a
tree of Python files (by default the running interpreter's standard library, PSF licence) into a code
request: an instruction, then the function's signature and docstring in a markdown block; the assistant
turn is the function as written in the source (a placeholder: regeneration replaces it with the target's
own answer). Rows are chat records (``{"messages": [...], "origin": "module:qualname"}``) in a JSON array
(``OUT.json[.gz]``, read by the ``sharegpt`` source's streaming reader, which needs no ``datasets``: a
``data.mix`` entry ``{source: sharegpt, path: OUT.json.gz}``) or JSON lines (``OUT.jsonl[.gz]``, the ``jsonl`` source); the decontamination
screen of the loader keeps any row that overlaps an evaluation prompt out, as for every source.

Worked example: ``posixpath.py`` defines ``def commonprefix(m): "Given a list of pathnames, returns the
longest common leading component" ...``; its row's user turn is::

    <instruction i mod 4>
    ```python
    def commonprefix(m):
        \"\"\"Given a list of pathnames, returns the longest common leading component\"\"\"
    ```

A method is shown inside its class (``class Name:`` then the stub indented by four spaces, its docstring's lines
too, so they read four spaces deeper than in the source). Files are read in sorted
path order and functions in source order; a stub seen before (same text) is skipped, so the output is a
pure function of the tree's contents.

Command line: ``python -m data_prep.code_prompts OUT.json.gz [--root DIR]`` (written atomically; gzip
with a fixed timestamp, so equal inputs give equal bytes).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import re
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: the user turn's first line, picked by the row's index modulo 4 (several phrasings, so that the drafter
#: does not learn one wrapper; none is EvalPlus's instruction, which the evaluation wraps HumanEval in)
INSTRUCTIONS = (
    "Complete the following Python function. Reply with the whole function in a markdown code block.",
    "Implement this Python function as its docstring describes:",
    "Write a Python implementation of the function below, then explain it briefly.",
    "Here is a Python function's signature and docstring. Write its body and show the complete function:",
)

#: folders of the standard library left out: tests, the GUI packages and demos, vendored and packaging helpers
#: (single modules stay, turtle.py among them)
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                           "pydoc_data", "site-packages", "dist-packages", "distutils", "__phello__"})


@dataclass(frozen=True)
class CodePrompt:
    """One documented function: ``origin`` ``module:qualname``; ``stub`` its signature and docstring
    (a method inside ``class Name:``); ``reference`` the whole definition as written (``ast.unparse``)."""

    origin: str
    stub: str
    reference: str


def _stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``fn``'s signature with its docstring as the whole body (decorators dropped)."""
    doc = fn.body[0]
    bare = type(fn)(name=fn.name, args=fn.args, body=[doc], decorator_list=[], returns=fn.returns,
                    type_comment=None, **({"type_params": fn.type_params} if "type_params" in fn._fields else {}))
    return ast.unparse(ast.fix_missing_locations(bare))


def function_prompts(source: str | bytes, module: str, min_doc_chars: int = 40,
                     max_doc_chars: int = 2000) -> list[CodePrompt]:
    """The documented public functions of one Python file, in source order.

    Taken: module-level functions and methods of module-level classes whose names (and class names) do not
    start with ``_``, with a docstring of ``min_doc_chars`` to ``max_doc_chars`` characters and at least one
    statement after it (a body to write).

    Args:
        source: the file's text, or its bytes (decoded by ``ast.parse`` as Python does: UTF-8 or the file's
            PEP 263 coding line).
        module: the dotted module name, for ``origin``.
        min_doc_chars, max_doc_chars: docstring length bounds (characters, after ``inspect.cleandoc``).

    Returns:
        :class:`CodePrompt` list; ``[]`` for a file that does not parse (e.g. written for another Python).
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []

    def take(fn, owner: str | None) -> None:
        if fn.name.startswith("_") or len(fn.body) < 2:
            return
        doc = ast.get_docstring(fn)
        if doc is None or not min_doc_chars <= len(doc) <= max_doc_chars:
            return
        stub, reference = _stub(fn), ast.unparse(fn)
        if owner is not None:
            stub = f"class {owner}:\n" + "\n".join("    " + line if line else line for line in stub.split("\n"))
        out.append(CodePrompt(f"{module}:{owner + '.' if owner else ''}{fn.name}", stub, reference))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            take(node, None)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    take(item, node.name)
    return out


def tree_prompts(root: Path, excluded: frozenset[str] = EXCLUDED_DIRS) -> list[CodePrompt]:
    """:func:`function_prompts` of every ``*.py`` under ``root`` (sorted paths; a folder in ``excluded``
    or starting with ``test`` anywhere in the relative path is skipped), a repeated stub kept once.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"code prompts: --root {root} is not a directory of Python files")
    seen, out = set(), []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in excluded or p.startswith("test") for p in parts[:-1]) or parts[-1].startswith("test"):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for p in function_prompts(path.read_bytes(), module):  # bytes: ast honours a PEP 263 coding line
            if p.stub not in seen:
                seen.add(p.stub)
                out.append(p)
    return out


def _fenced(code: str) -> str:
    """``code`` in a markdown python block whose fence is longer than any backtick run inside it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", code)), default=0))
    return f"{fence}python\n{code}\n{fence}"


def chat_rows(prompts: list[CodePrompt]) -> list[dict]:
    """Chat rows of ``prompts``: row ``i`` asks with ``INSTRUCTIONS[i % 4]`` and the stub in a ```python
    block (a longer fence where the code holds three backticks); the assistant turn is the reference definition
    in one (replaced by regeneration)."""
    return [{"messages": [
        {"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n{_fenced(p.stub)}"},
        {"role": "assistant", "content": _fenced(p.reference)}], "origin": p.origin}
        for i, p in enumerate(prompts)]


def write_rows(rows: list[dict], out: Path) -> None:
    """Write ``rows`` to ``out`` atomically (a temp file renamed): a JSON array, one row a line, for a name ending
    in ``.json`` or ``.json.gz`` (read by the ``sharegpt`` source, which needs no ``datasets``), else JSON lines
    (the ``jsonl`` source); ``.gz`` names are gzipped with timestamp 0 (the same rows give the same bytes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    array = out.name.endswith((".json", ".json.gz"))
    data = ("[\n" + ",\n".join(lines) + "\n]\n" if array else "".join(x + "\n" for x in lines)).encode("utf-8")
    if out.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600: the file is for every reader
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="file to write: .json / .json.gz (a JSON array) or .jsonl / .jsonl.gz")
    ap.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="tree of Python files (default: this interpreter's standard library)")
    args = ap.parse_args(argv)
    rows = chat_rows(tree_prompts(args.root))
    write_rows(rows, args.out)
    print(f"code prompts: {len(rows)} functions from {args.root} -> {args.out}")


if __name__ == "__main__":
    main()
