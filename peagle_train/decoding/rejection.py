"""Acceptance rules of the reference speculative-decoding loop (spec §4): greedy and
speculative-sampling verification of one round of drafts.

Used by :func:`peagle_train.decoding.speculative.speculative_generate`; every name is re-exported from
:mod:`peagle_train.decoding.speculative`.

Shapes: ``K`` served draft tokens, ``V`` target vocab.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

#: ``accept_rule(p_d, q_d) -> acceptance probability`` for a draft token ``d`` (0-dim tensors).
AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def standard_accept_rule(p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """``min(1, p(d) / q(d))``: speculative sampling (Leviathan et al. 2023, Chen et al. 2023)."""
    return torch.clamp(p_d / q_d, max=1.0)


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix of drafts equal to the target argmax.

    Args:
        draft_ids: ``[K]`` int64 target ids. target_logits: ``[K+1, V]`` target logits at
            ``[b, d1..dK]`` (row ``i`` predicts the token after draft ``i``).

    Returns:
        ``(a, next_token)``: accepted drafts ``0..K`` and the target's argmax after them
        (the correction token on a rejection, the bonus token when all ``K`` are accepted).
    """
    greedy = target_logits.argmax(-1)  # [K+1]
    match = (draft_ids.to(greedy.device) == greedy[:-1]).to(torch.int64)
    a = int(match.cumprod(0).sum())
    return a, int(greedy[a])


def verify_sampling(
    draft_ids: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
    accept_rule: AcceptRule | None = None,
) -> tuple[int, int]:
    """Speculative-sampling verification (Leviathan et al. 2023; Chen et al. 2023; vLLM
    ``vllm/v1/sample/rejection_sampler.py``): the emitted tokens are distributed exactly as
    sampling from the target alone.

    For ``i = 1..K``: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; on the first
    rejection sample the next token from ``norm(max(0, p_i - q_i))`` and stop. If all ``K`` are
    accepted, sample the bonus token from ``p_{K+1}``.

    Args:
        draft_ids: ``[K]`` int64 target ids, ``d_i ~ q_i``.
        q: ``[K, V]`` drafter distributions on the target vocab.
        p: ``[K+1, V]`` target distributions (same temperature as ``q``).
        generator: ``torch.Generator`` on ``p``'s device.
        accept_rule: test hook replacing ``min(1, p/q)``; production callers leave it ``None``.

    Returns:
        ``(a, next_token)`` with ``a`` accepted drafts.
    """
    rule = accept_rule or standard_accept_rule
    K = draft_ids.numel()
    u = torch.rand(K, generator=generator, device=p.device, dtype=p.dtype)  # [K]
    q = q.to(device=p.device, dtype=p.dtype)
    for i in range(K):
        d = int(draft_ids[i])
        if bool(u[i] < rule(p[i, d], q[i, d])):
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)  # [V]
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0])
    return K, int(torch.multinomial(p[K], 1, generator=generator)[0])
