"""The house's import rules, read from the source with ``ast`` (in-function imports included).

* No import circles among the modules of ``peagle_train`` and ``data_prep``.
* ``data_prep`` imports nothing from ``peagle_train`` (peagle_train uses data_prep, never the reverse).
* Inside ``peagle_train`` a module imports only from its own stage or a lower one, in the order of
  :data:`LAYERS` (written down here once; ``docs/architecture.md`` describes it in words).
* The trainer, the exporter, the evaluator and the decoding loop name no draft method: what differs
  between methods lives in ``peagle_train/methods/`` behind :class:`~peagle_train.methods.base.DraftMethod`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: peagle_train's stages, lowest first: a module may import from its own stage and the stages before it.
LAYERS = ("core", "features", "peagle", "kernels", "model", "methods", "recipe", "decoding", "distributed",
          "trainer", "export", "eval", "stages", "cli")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph(packages=("peagle_train", "data_prep")) -> dict[str, set[str]]:
    """``{module: {imported project modules}}`` for every ``.py`` file of ``packages``; ``from pkg import
    name`` counts as an import of ``pkg.name`` where that is a module, else of ``pkg``."""
    files = {_module(p): p for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # a name inside a module: the module itself
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    deps.add(name)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d in graph and not _is_package_of(d, m):
                if state.get(d) == 1:
                    return stack[stack.index(d):] + [d]
                if d not in state and (c := visit(d)):
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def _is_package_of(pkg: str, mod: str) -> bool:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: not a circle of the code."""
    return mod.startswith(pkg + ".")


def layer_of(mod: str) -> int | None:
    """Index in :data:`LAYERS` of a ``peagle_train`` module (None: the package's own ``__init__``)."""
    parts = mod.split(".")
    if parts[0] != "peagle_train" or len(parts) == 1:
        return None
    return LAYERS.index(parts[1])


def test_every_peagle_train_module_sits_in_a_layer():
    for mod in import_graph():
        if mod.startswith("peagle_train."):
            assert mod.split(".")[1] in LAYERS, f"{mod} is in no stage of LAYERS: place it or add the stage"


def test_no_import_circles():
    assert find_cycle(import_graph()) is None, f"import circle: {' -> '.join(find_cycle(import_graph()))}"


def test_data_prep_imports_nothing_from_peagle_train():
    bad = {m: sorted(d for d in deps if d.startswith("peagle_train")) for m, deps in import_graph().items()
           if m.startswith("data_prep")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_no_import_from_a_lower_stage_into_a_higher_one():
    bad = []
    for mod, deps in import_graph().items():
        lo = layer_of(mod)
        for d in deps:
            ld = layer_of(d)
            if lo is not None and ld is not None and ld > lo:
                bad.append(f"{mod} ({LAYERS[lo]}) imports {d} ({LAYERS[ld]})")
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_catch_what_they_forbid():
    """The three rules fail on a made-up graph that breaks them (the tests above cannot pass vacuously)."""
    g = {"peagle_train.core.a": {"peagle_train.trainer.t"}, "peagle_train.trainer.t": {"peagle_train.core.a"}}
    assert find_cycle(g) == ["peagle_train.core.a", "peagle_train.trainer.t", "peagle_train.core.a"]
    assert layer_of("peagle_train.core.a") < layer_of("peagle_train.trainer.t")
    real = import_graph()
    assert "peagle_train.methods.base" in real["peagle_train.trainer.trainer"] or \
        "peagle_train.methods" in real["peagle_train.trainer.trainer"]
    assert "data_prep.template" in real["peagle_train.stages"]  # in-function imports are read too


#: what names a draft method in code: the registry names as string constants, and the method classes.
METHOD_STRINGS = {"peagle", "eagle3", "parallel"}
METHOD_IDENTIFIER = re.compile(r"^_?(PEagle|Eagle3)")
#: modules that must hold no method names: the trainer, the exporter, the evaluator, the decoding loop.
METHOD_FREE = ("peagle_train/trainer", "peagle_train/export/writer.py", "peagle_train/eval",
               "peagle_train/decoding", "peagle_train/stages.py", "peagle_train/recipe.py")


def method_mentions(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every string constant equal to a method name and every identifier or
    attribute of a method class in ``source``; docstrings do not count (they may explain methods)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0].value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in METHOD_STRINGS:
                out.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Name) and METHOD_IDENTIFIER.match(node.id):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and METHOD_IDENTIFIER.match(node.attr):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.alias) and METHOD_IDENTIFIER.match(node.asname or node.name.rpartition(".")[2]):
            out.append((node.lineno, node.name))
    return out


def test_method_mentions_finds_names_but_not_prose():
    src = 'def f(m):\n    """Explains "peagle" and PEagle."""\n    return m == "eagle3" or PEagleObjective\n'
    assert sorted(method_mentions(src)) == [(3, "'eagle3'"), (3, "PEagleObjective")]


@pytest.mark.parametrize("place", METHOD_FREE)
def test_no_method_names_outside_methods(place):
    """The trainer, exporter, evaluator and decoding loop hold no method names: they ask the method
    (``methods/``). ``export/check.py`` and ``model_card.py`` read vLLM's own fields
    (``parallel_drafting``, vLLM's ``"method": "eagle3"``), the export contract, not ours."""
    path = ROOT / place
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    hits = [f"{f.relative_to(ROOT)}:{line}: {what}" for f in files for line, what in method_mentions(f.read_text())]
    assert not hits, "method-specific code outside peagle_train/methods/:\n" + "\n".join(hits)
