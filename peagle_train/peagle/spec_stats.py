"""Statistics of the reference speculative-decoding loop: per-round acceptance, acceptance
length, per-position acceptance and timings of :func:`peagle_train.decoding.speculative.speculative_generate`
and :func:`peagle_train.decoding.speculative.target_generate`.

The loop's names (``SpecStats``, ``TargetStats``, ``acceptance_length``,
``per_position_acceptance``) are re-exported from :mod:`peagle_train.decoding.speculative`;
``chain_matrix`` / ``walk_accepted`` (the training-time replay of the loop) live here only.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Statistics of one :func:`speculative_generate` call (times in seconds, ``time.perf_counter``).

    Attributes:
        K: served draft tokens per round.
        accepted: per verification round, drafts accepted ``0..K``.
        draft_s: per round, time to build the proposal it verified (the first one also runs
            the drafter over the whole prompt).
        verify_s: per round, target forward over ``K+1`` positions + acceptance + cache crop.
        prefill_s: target prefill over the prompt and the first token.
        total_s: wall time of the whole call.
        new_tokens: tokens returned (after truncation at ``max_new_tokens`` / EOS).
    """

    K: int
    accepted: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_length(self) -> float:
        """Mean ``accepted + 1`` tokens per verification round (NaN with no round)."""
        return acceptance_length(self.accepted)

    @property
    def tokens_per_s(self) -> float:
        """Returned tokens / ``total_s`` (tokens/s, prefill included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def per_position(self) -> list[float]:
        """Acceptance rate at draft position ``i = 1..K``: rounds accepting ``d_i`` / rounds reaching ``d_i``."""
        return per_position_acceptance(self.accepted, self.K)

    def to_dict(self) -> dict:
        return {
            "K": self.K, "rounds": self.rounds, "accepted": list(self.accepted),
            "acceptance_length": self.acceptance_length, "per_position_acceptance": self.per_position(),
            "draft_s": list(self.draft_s), "verify_s": list(self.verify_s), "prefill_s": self.prefill_s,
            "total_s": self.total_s, "new_tokens": self.new_tokens, "tokens_per_s": self.tokens_per_s,
        }


def acceptance_length(accepted: Iterable[int]) -> float:
    """Mean of ``accepted + 1`` over rounds: tokens emitted per target forward (NaN if empty)."""
    acc = list(accepted)
    return sum(a + 1 for a in acc) / len(acc) if acc else float("nan")


def per_position_acceptance(accepted: Iterable[int], K: int) -> list[float]:
    """``[K]`` rates: rounds with ``a >= i`` / rounds with ``a >= i-1`` for ``i = 1..K`` (NaN if none reached)."""
    acc = list(accepted)
    out = []
    for i in range(1, K + 1):
        reached = sum(a >= i - 1 for a in acc)
        out.append(sum(a >= i for a in acc) / reached if reached else float("nan"))
    return out


@dataclass
class TargetStats:
    """Statistics of one :func:`target_generate` call (seconds; tokens/s includes the prefill)."""

    prefill_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "total_s": self.total_s, "new_tokens": self.new_tokens,
                "tokens_per_s": self.tokens_per_s}


def chain_matrix(anchor, depth, ok, sup, n: int, K: int):
    """Per-anchor chain tables from grid elements (training-time evaluation grid, every chain kept).

    Args:
        anchor, depth: ``[E]`` int64 grid coordinates, ``0 <= anchor < n``, ``0 <= depth < K``
            (an index out of range raises ``IndexError``). ok: ``[E]`` bool, drafter greedy ==
            target greedy (False where the target token is outside the draft vocab: the drafter
            cannot propose it). sup: ``[E]`` bool, supervised (the label is a response token;
            do not fold the draft-vocab test in here, or the replay would stop at such a token).
        n: sequence length (anchors ``0..n-1``). K: trained depths.

    Returns:
        ``(ok [n, K] bool, sup [n, K] bool)`` on the CPU; anchors/depths absent from the grid are False.
    """
    import torch

    a, d = anchor.cpu().long(), depth.cpu().long()
    ok_t = torch.zeros(n, K, dtype=torch.bool)
    sup_t = torch.zeros(n, K, dtype=torch.bool)
    ok_t[a, d] = ok.cpu().bool() & sup.cpu().bool()
    sup_t[a, d] = sup.cpu().bool()
    return ok_t, sup_t


def walk_accepted(ok, sup, first_response_token: int, K: int, horizon: int | None = None) -> list[int]:
    """Accepted drafts per verification round of the greedy decoding loop, replayed on a
    teacher-forced sequence from the training-time predictions (loop-equivalent simulated AL).

    The reference loop (:func:`peagle_train.decoding.speculative.speculative_generate`) gets the first
    response token ``x[P]`` from the target's prefill; each round then drafts from anchor ``a``
    (target hidden states known up to ``a``, bonus token ``x[a+1]``) the tokens ``x[a+2..a+1+K]``
    (grid element ``(a, d)`` predicts ``x[a+2+d]``, spec §2), accepts the longest correct prefix
    ``n`` and continues at anchor ``a+1+n``. So the first round's anchor is ``P-1``. When the
    sequence is the target's own greedy output (regenerated data, greedy fp32 target) the loop
    on its prompt visits exactly these rounds, which makes this the number to compare with the
    measured acceptance length (the position-averaged
    :meth:`peagle_train.peagle.metrics.DepthStats.simulated_acceptance_length` weights easy stretches more
    than the loop does and reads higher).

    At the end of a response the loop may accept drafts past the end-of-turn token (then
    truncated); the replay stops counting at the last supervised label, so the last round can
    count fewer accepted drafts than the loop's.

    Args:
        ok, sup: ``[n, K_trained]`` bool from :func:`chain_matrix`.
        first_response_token: ``P``, index of the first supervised (assistant) token.
        K: served draft tokens per round (``<= K_trained``).
        horizon: stop once ``horizon`` response tokens exist (the loop's ``max_new_tokens``);
            None: walk to the end of the first assistant turn.

    Returns:
        Accepted counts ``0..K`` per round (feed to :func:`acceptance_length`).

    Raises:
        ValueError: ``K`` larger than the tables' depth, or ``first_response_token < 1``.
    """
    n, k_tab = ok.shape
    if K > k_tab:
        raise ValueError(f"served K={K} exceeds the trained depths ({k_tab})")
    if first_response_token < 1:
        raise ValueError(f"first_response_token must be >= 1 (got {first_response_token})")
    ok_l, sup_l = ok[:, :K].tolist(), sup[:, :K].tolist()
    rounds, emitted, a = [], 1, first_response_token - 1
    while a < n and sup_l[a][0] and (horizon is None or emitted < horizon):
        acc = 0
        while acc < K and sup_l[a][acc] and ok_l[a][acc]:
            acc += 1
        rounds.append(acc)
        emitted += acc + 1
        a += acc + 1
    return rounds
