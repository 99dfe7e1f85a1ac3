"""Draft vocabulary (``d2t`` / ``t2d``) from loss-masked token frequencies (spec §2).

The draft vocab is the ``Vd`` most frequent target tokens among the supervised
(assistant) tokens of the training data, sorted by id; ties are broken by the
smaller id, so the result is deterministic. ``d2t[i] = draft_ids[i] - i`` and
``t2d`` is a bool mask over the target vocab (EAGLE-3 convention, vLLM
``llama_eagle3.py`` adds ``d2t`` to the argmax of the draft logits).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def token_frequencies(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """Counts ``[V]`` int64 of tokens at loss-masked positions.

    Args:
        sequences: iterable of ``(input_ids, loss_mask)`` pairs (lists of equal length).
        vocab_size: ``V``.

    Raises:
        ValueError: a token id outside ``[0, V)`` or mismatched lengths (names the row).
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row, (ids, mask) in enumerate(sequences):
        if len(ids) != len(mask):
            raise ValueError(f"row {row}: input_ids ({len(ids)}) and loss_mask ({len(mask)}) lengths differ")
        t = torch.as_tensor(ids, dtype=torch.int64)
        if t.numel() and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(f"row {row}: token id outside [0, {vocab_size})")
        m = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(t[m], minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, exclude: Iterable[int] = ()) -> torch.Tensor:
    """The ``Vd`` most frequent ids, sorted ascending (int64 ``[Vd]``).

    Ties (including never-seen tokens) go to the smaller id. ``exclude`` ids (the
    mask token) are never chosen unless ``Vd == V``.

    Raises:
        ValueError: ``Vd`` outside ``[1, V]``.
    """
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {V}]")
    if draft_vocab_size == V:
        return torch.arange(V, dtype=torch.int64)
    score = counts.to(torch.float64).clone()
    for e in exclude:
        score[e] = -1.0
    # stable sort on (-count, id): sort by id first (already), then stable by -count
    order = torch.sort(-score, stable=True).indices
    return order[:draft_vocab_size].sort().values


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t [Vd]`` int64 offsets and ``t2d [V]`` bool from sorted draft ids."""
    d2t = draft_ids - torch.arange(draft_ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d
