"""The user-facing docs speak of the project, not of how it was built (issue 21).

README.md and docs/*.md are pages for users: no word of the sessions, device calls, helpers or
transfer limits of the machinery that measured or wrote them. Genuine technical uses of a listed
word go in :data:`ALLOWED`, each with its reason.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: lab-notebook wording: how a page was made, not what the project does
BANNED = re.compile(r"session|device call|helper-|64 MiB", re.IGNORECASE)
#: (page, exact phrase containing a banned word, reason it is technical): none needed today
ALLOWED: list[tuple[str, str, str]] = []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_docs_have_no_lab_notebook_wording(page):
    text = page.read_text()
    for name, phrase, _reason in ALLOWED:
        if page.name == name:
            text = text.replace(phrase, "")
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {text[max(0, m.start() - 40):m.end() + 40]!r}"
            for m in BANNED.finditer(text)]
    assert not hits, f"{page.relative_to(ROOT)} reads as a lab notebook:\n" + "\n".join(hits)


def test_benchmarks_page_has_the_trainer_throughput_section():
    """docs/benchmarks.md keeps a titled section for the real trainer's throughput near the top."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert "## Trainer throughput" in heads[:3], heads[:3]


#: a repository path as the pages cite it (not a ``pkg:`` resource name, which the package resolves)
CITED = re.compile(r"(?<![\w/.:])((?:docs|benchmarks|recipes|peagle_train|data_prep|tests|launch)/"
                   r"[A-Za-z0-9_./-]*[A-Za-z0-9_/](?:\.\{[A-Za-z0-9_,.]+\})?)")


def cited_paths(text: str) -> list[str]:
    """The repository paths a page cites, brace lists expanded (``a.{json,log}`` -> ``a.json``, ``a.log``);
    paths with a placeholder (``<commit>``, ``*``) are left out."""
    out = []
    for m in CITED.finditer(text):
        if text[m.end():m.end() + 1] in ("<", "*"):
            continue
        path, _, braces = m.group(1).partition("{")
        out += [path + alt for alt in braces.rstrip("}").split(",")] if braces else [path]
    return out


def test_cited_paths_are_parsed_as_written():
    text = "see `docs/data/a_1.{json,log}`, docs/data/quality/ and `pkg:peagle_train/x.json`, not docs/data/x_<c>.json"
    assert cited_paths(text) == ["docs/data/a_1.json", "docs/data/a_1.log", "docs/data/quality/"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_cited_file_is_in_the_repository(page):
    """A raw file, script or recipe a page cites exists (a number whose raw file is missing cannot be checked)."""
    missing = sorted({p for p in cited_paths(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} cites files the repository lacks: {missing}"
