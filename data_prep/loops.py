"""Repetition loops in regenerated answers: which supervised tokens the context already predicts, and
the looping tails ``data.loop_tail: unsupervise`` takes out of the loss.

Greedy regeneration by a small target falls into loops (SmolLM2-135M, 42 ShareGPT prompts capped at
384 tokens: half the supervised tokens, 83 % of those past the 256th answer token; docs/results.md).
A loop's continuation can be copied from the context at every depth, so a drafter trained on it
spends its steps on the easiest tokens, and an evaluation on it rewards copying. Pure functions on
token ids and loss masks (lists of ints); no model.
"""
from __future__ import annotations

#: the lookup's context: a token is copyable when the N tokens before it were followed by it earlier
LOOKUP_N = 4
#: a looping tail: a suffix of an answer of at least this many tokens ...
MIN_TAIL = 64
#: ... of which at least this fraction is copyable
TAIL_FRACTION = 0.9
#: tokens of a looping tail that stay supervised (the drafter still learns to continue a loop)
KEEP_TOKENS = 32
#: regen.stop_loops looks for a loop in an answer's last this many tokens (a loop of a longer period goes on)
LOOP_WINDOW = 256
#: the tail starts where a window of this many tokens is TAIL_FRACTION copyable (not inside fresh text
#: that a long loop after it outweighs)
START_WINDOW = 16


def copyable_flags(ids: list[int], mask: list[int], n: int = LOOKUP_N) -> list[tuple[int, bool]]:
    """``(position in its answer, copyable)`` for each supervised token of one sequence, in order.

    A supervised token ``ids[i]`` is copyable when ``ids[i-n:i]`` occurred earlier in the sequence and
    was followed there by ``ids[i]`` (the rule of n-gram / prompt-lookup drafting). Its position in its
    answer counts tokens since its supervised span (a run of loss-mask 1) began. A token with fewer than
    ``n`` tokens before it is not copyable.

    Example (n = 2): ids ``[9, 5, 6, 5, 6, 5, 6]``, mask ``[0, 1, 1, 1, 1, 1, 1]`` gives ``[(0, False),
    (1, False), (2, False), (3, False), (4, True), (5, True)]``: ``5, 6`` was followed by ``5`` at index
    3, so ``5`` at index 5 is copyable, and ``6, 5`` by ``6`` at index 4, so ``6`` at index 6 is.

    Raises:
        ValueError: ids and mask of different lengths, or n < 1.
    """
    if len(ids) != len(mask) or n < 1:
        raise ValueError(f"ids ({len(ids)}) and mask ({len(mask)}) must have one length, n ({n}) must be >= 1")
    seen: dict[tuple[int, ...], set[int]] = {}
    out, pos = [], -1
    for i, t in enumerate(ids):
        pos = (pos + 1 if i and mask[i - 1] else 0) if mask[i] else -1
        key = tuple(ids[i - n:i]) if i >= n else None
        if mask[i]:
            out.append((pos, key is not None and t in seen.get(key, ())))
        if key is not None:
            seen.setdefault(key, set()).add(t)
    return out


def unsupervise_loop_tails(ids: list[int], mask: list[int], n: int = LOOKUP_N, min_tail: int = MIN_TAIL,
                           fraction: float = TAIL_FRACTION, keep: int = KEEP_TOKENS,
                           window: int = START_WINDOW) -> tuple[list[int], list[int], int]:
    """Take each answer's looping tail out of the loss, and drop the unsupervised tokens it leaves at the end.

    Per supervised span ``[s, e)`` (a run of loss-mask 1: one assistant turn), the tail starts at the
    first ``p`` with ``e - p >= min_tail`` whose suffix ``[p, e)`` is at least ``fraction`` copyable
    (:func:`copyable_flags`), moved forward to the first ``p'`` whose ``window`` tokens ``[p', p' + window)``
    are at least ``fraction`` copyable too (a long loop may outweigh fresh text before it; that text stays
    supervised); the mask of ``[p' + keep, e)`` becomes 0. When a tail was found, tokens after
    the sequence's last supervised token are then removed (nothing is learned from them; an earlier
    turn's tail stays as the context of the later turns); a sequence without one is returned as it was.

    Example (n = 1, min_tail = 4, fraction = 0.9, keep = 1, window = 2): ids ``[9, 1, 2, 1, 2, 1, 2, 1]``, mask
    ``[0, 1, 1, 1, 1, 1, 1, 1]``: copyable flags of the 7 answer tokens ``F F F T T T T``; the first
    suffix of >= 4 tokens that is >= 90 % copyable starts at index 4 (``2 1 2 1``, 4 of 4; its 2-token
    window is copyable too), so index 5 onward is unsupervised and removed: ids ``[9, 1, 2, 1, 2]``, mask ``[0, 1, 1, 1, 1]``, 3 tokens
    unsupervised.

    Returns:
        ``(ids, mask, unsupervised)``: new lists (the inputs are not changed) and the number of
        tokens whose mask went from 1 to 0 (removed ones included).

    Raises:
        ValueError: as :func:`copyable_flags`; ``min_tail`` < 1, ``keep`` < 0 or ``fraction`` outside (0, 1].
    """
    if min_tail < 1 or keep < 0 or not 0 < fraction <= 1:
        raise ValueError(f"min_tail ({min_tail}) >= 1, keep ({keep}) >= 0 and 0 < fraction ({fraction}) <= 1 required")
    flags = [c for _, c in copyable_flags(ids, mask, n)]
    mask = list(mask)
    spans, i = [], 0
    while i < len(mask):  # supervised spans [s, e)
        if mask[i]:
            s = i
            while i < len(mask) and mask[i]:
                i += 1
            spans.append((s, i))
        else:
            i += 1
    unsupervised, k = 0, 0  # k: index of the span's first token in flags
    for s, e in spans:
        c = flags[k:k + e - s]
        k += e - s
        suffix = [0] * (len(c) + 1)
        for j in range(len(c) - 1, -1, -1):
            suffix[j] = suffix[j + 1] + c[j]
        for j in range(len(c) - min_tail + 1):
            if suffix[j] >= fraction * (len(c) - j):
                w = min(window, len(c) - j)
                while j + w <= len(c) and suffix[j] - suffix[j + w] < fraction * w:
                    j += 1  # fresh text before the loop: the tail starts at the first copyable window
                for q in range(s + j + keep, e):
                    mask[q] = 0
                    unsupervised += 1
                break
    if not unsupervised:  # no looping tail: the sequence as it was (its template's trailing tokens too)
        return list(ids), mask, 0
    last = max((q for q, m in enumerate(mask) if m), default=-1)
    return list(ids[:last + 1]), mask[:last + 1], unsupervised


def ends_in_loop(ids: list[int], n: int = LOOKUP_N, tail: int = MIN_TAIL, fraction: float = TAIL_FRACTION,
                 window: int = LOOP_WINDOW) -> bool:
    """Whether generated ``ids`` end in a repetition loop: at least ``fraction`` of the last ``tail`` tokens are
    copyable (:func:`copyable_flags`) with the last ``window`` tokens as the context (the rule of
    :func:`unsupervise_loop_tails` on a bounded window, so the check costs O(window) per row whatever the answer's
    length: ``regen.stop_loops`` runs it on every row between segments).

    Example (n = 1, tail = 4, fraction = 0.9, window = 8): ``[5, 6, 7, 1, 2, 1, 2, 1, 2, 1, 2]`` ends in a loop
    (in the window ``1 2 1 2 1 2 1 2`` each of the last 4 tokens follows a token that was followed by it before);
    ``[5, 6, 7, 1, 2, 1, 2, 1, 2]`` does not yet (the window ``6 7 1 2 1 2 1 2``: the first ``1`` of the last four
    follows the first ``2``, which was not followed before: 3 of 4); ``[1, 2, 1, 2, 3, 4, 5, 6]`` does not;
    fewer than ``tail + n`` tokens never do.

    Raises:
        ValueError: ``tail`` < 1, ``window`` < ``tail`` or ``fraction`` outside (0, 1].
    """
    if tail < 1 or window < tail or not 0 < fraction <= 1:
        raise ValueError(f"tail ({tail}) >= 1, window ({window}) >= tail and 0 < fraction ({fraction}) <= 1 required")
    if len(ids) < tail + n:
        return False
    w = list(ids[-window:])
    flags = copyable_flags(w, [0] * (len(w) - tail) + [1] * tail, n)
    return sum(c for _, c in flags) >= fraction * tail
