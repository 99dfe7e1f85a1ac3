"""Statistics of the reference speculative-decoding loop: per-round acceptance, acceptance
length, per-position acceptance and timings of :func:`peagle_train.speculative.speculative_generate`
and :func:`peagle_train.speculative.target_generate`.

Every name is re-exported from :mod:`peagle_train.speculative`.
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
