"""Keep evaluation prompts out of the training data (``data.decontaminate``).

A drafter evaluated on MT-Bench or HumanEval prompts it was trained on reports an acceptance length
it will not reach on a user's prompts. Before the train/eval split, every source conversation is
screened against the prompts of the evaluation sets the recipe measures (``eval.datasets``, e.g.
``mt_bench``, ``humaneval``, ``arena_hard``; the ``heldout`` set is the recipe's own eval split and
cannot overlap training by construction): a conversation is dropped when one of its **user** turns

* shares a run of :data:`NGRAM` consecutive words with an evaluation prompt (the rule of the GPT-3
  paper's contamination analysis, Brown et al. 2020, appendix C: 13-gram overlap), or
* equals an evaluation prompt shorter than :data:`NGRAM` words,

words compared after :func:`words` (lower case, punctuation and whitespace ignored), so a prompt
pasted into a longer message, re-wrapped or re-cased is still found; an n-gram of fewer than
:data:`MIN_DISTINCT` distinct words (a counting run, a repeated word) does not count. Dropped conversations
are counted per evaluation set in the source report (``eval_overlap``); the selection then goes on
reading the source, so ``data.num_conversations`` is still met where the source has enough.

Example: the MT-Bench question "Compose an engaging travel blog post about a recent trip to Hawaii,
highlighting cultural experiences and must-see attractions." inside a ShareGPT message
"please help: compose an engaging travel blog post about a recent trip to hawaii, highlighting
cultural experiences ..." is found (13 shared words in a row); "Write a blog post about Hawaii"
is not.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

#: Words in a row that make an overlap (Brown et al. 2020, appendix C).
NGRAM = 13
#: An n-gram counts only with at least this many distinct words: runs like "0 1 2 3 …" or a line of
#: repeated words are shared by unrelated texts.
MIN_DISTINCT = 7
_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """``text`` as lower-case words (runs of letters, digits and ``_``): punctuation, markup and
    whitespace are ignored, so ``"-----"`` rules and re-wrapped lines do not matter."""
    return _WORD.findall(text.lower())


def _ngrams(ws: list[str], n: int) -> Iterable[tuple[str, ...]]:
    for i in range(len(ws) - n + 1):
        g = tuple(ws[i:i + n])
        if len(set(g)) >= min(MIN_DISTINCT, n):
            yield g


class EvalOverlap:
    """The screen: which evaluation set (if any) a conversation's user turns overlap.

    Args:
        prompts: ``{set name: [prompt, ...]}``, each prompt the list of its user turns (as
            :func:`data_prep.eval_prompts.load_eval_prompts` returns them).
        n: words in a row that make an overlap (:data:`NGRAM`).

    Raises:
        ValueError: ``n < 1``.
    """

    def __init__(self, prompts: dict[str, list[list[str]]], n: int = NGRAM):
        if n < 1:
            raise ValueError(f"EvalOverlap: n={n} must be >= 1")
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}  # n-gram -> the first set holding it
        self.short: dict[tuple[str, ...], str] = {}  # whole prompts under n words -> set
        self.sizes = {name: sum(len(p) for p in ps) for name, ps in prompts.items()}
        for name, ps in prompts.items():
            for turn in (t for p in ps for t in p):
                ws = words(turn)
                if len(ws) < n:
                    self.short.setdefault(tuple(ws), name)
                for g in _ngrams(ws, n):
                    self.grams.setdefault(g, name)

    def __call__(self, conversation: list[dict]) -> str | None:
        """The evaluation set one of ``conversation``'s user turns overlaps, or None.

        Args:
            conversation: normal-form messages (``{"role", "content"}``; only ``role == "user"`` is read).
        """
        for m in conversation:
            if m["role"] != "user":
                continue
            ws = words(m["content"])
            hit = self.short.get(tuple(ws))
            if hit is not None:
                return hit
            for g in _ngrams(ws, self.n):
                hit = self.grams.get(g)
                if hit is not None:
                    return hit
        return None


def eval_overlap_screen(eval_sets: Iterable[str]) -> EvalOverlap | None:
    """The :class:`EvalOverlap` of every prompt of ``eval_sets`` (names of
    :data:`data_prep.eval_prompts.EVAL_SETS`; others, e.g. ``heldout``, are skipped); None when none is left.

    Raises:
        FileNotFoundError: a set's distribution is not installed (the message says what to install).
    """
    from data_prep.eval_prompts import EVAL_SETS, HUMANEVAL_INSTRUCTION, load_eval_prompts

    names = [s for s in dict.fromkeys(eval_sets) if s in EVAL_SETS]
    if not names:
        return None
    # the evaluation content, not the instruction the evaluator wraps HumanEval's problems in (a training
    # message asking for "a self-contained Python script" in the same words is no leak of a problem)
    return EvalOverlap({s: [[t.replace(HUMANEVAL_INSTRUCTION, "") for t in p] for p in load_eval_prompts(s, 10 ** 6)]
                        for s in names})
