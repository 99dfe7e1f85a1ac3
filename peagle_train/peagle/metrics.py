"""Per-depth training metrics and the acceptance length they predict (spec §3 "Loss and metrics").

Pure tensor functions: the trainer accumulates :class:`DepthStats` on the device, the model card
reads :func:`simulated_acceptance_lengths`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def simulated_acceptance_lengths(cond: list[float]) -> list[float]:
    """``AL(k)`` for ``k = 1..len(cond)`` from conditional accuracies (spec §3); NaN depths end the chain.

    Example: ``cond = [0.8, 0.5]`` → ``[1.8, 2.2]`` (``1 + 0.8``, ``1 + 0.8 + 0.8*0.5``).
    """
    out, al, prod, stopped = [], 1.0, 1.0, False
    for c in cond:
        stopped = stopped or c != c  # NaN: no data at this depth, the chain stops here
        if stopped:
            out.append(float("nan"))
            continue
        prod *= c
        al += prod
        out.append(al)
    return out


@dataclass
class DepthStats:
    """Summed counts per depth, to be added across micro-batches/ranks, then turned into metrics.

    All ``[K]`` float64: ``acc_num/acc_den`` top-1 accuracy, ``cond_num/cond_den``
    accuracy given all shallower depths of the chain were correct.
    """

    acc_num: torch.Tensor
    acc_den: torch.Tensor
    cond_num: torch.Tensor
    cond_den: torch.Tensor

    @classmethod
    def zeros(cls, K: int, device=None) -> "DepthStats":
        """All-zero counts for ``K`` depths, float64 on ``device`` (None: the default device)."""
        z = lambda: torch.zeros(K, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z(), z())

    def add(self, other: "DepthStats") -> "DepthStats":
        return DepthStats(*(a + b for a, b in zip(self.as_tensor(), other.as_tensor())))

    def as_tensor(self):
        return (self.acc_num, self.acc_den, self.cond_num, self.cond_den)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.as_tensor())

    @classmethod
    def from_stacked(cls, t: torch.Tensor) -> "DepthStats":
        return cls(*t.double().cpu().unbind(0))

    def accuracy(self) -> list[float]:
        return [float(n / d) if d > 0 else float("nan") for n, d in zip(self.acc_num, self.acc_den)]

    def conditional_accuracy(self) -> list[float]:
        return [float(n / d) if d > 0 else float("nan") for n, d in zip(self.cond_num, self.cond_den)]

    def simulated_acceptance_length(self, K: int | None = None) -> float:
        """``AL(K) = 1 + sum_{k=1..K} prod_{j<k} acc_cond(j)`` (spec §3); ``acc_cond(0)`` = depth-0 accuracy."""
        cond = self.conditional_accuracy()
        als = [a for a in simulated_acceptance_lengths(cond[:K]) if a == a]
        return als[-1] if als else 1.0  # the chain stops at the first depth without data


def depth_stats(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    weight: torch.Tensor,
    correct: torch.Tensor,
    in_vocab: torch.Tensor,
    K: int,
    n_anchors: int | None = None,
) -> DepthStats:
    """Per-depth accuracy and conditional accuracy of one grid (the inputs of the simulated
    acceptance length, PEAGLE_SPEC §3: depth d counts when depths 0..d-1 of its anchor's chain were right).

    Computed on the inputs' device; with ``n_anchors`` given there is no host sync (the training step
    calls it after every micro-batch).

    Args:
        anchor, depth: ``[E]`` int64. weight: ``[E]`` (>0 = supervised).
        correct: ``[E]`` bool, drafter greedy == target greedy.
        in_vocab: ``[E]`` bool, target greedy is in the draft vocab (others are excluded).
        K: depths.
        n_anchors: an upper bound on ``anchor`` + 1 (e.g. the packed token count); None = read it
            from ``anchor`` (one host sync).

    Returns:
        :class:`DepthStats` (float64, on the inputs' device).

    Raises:
        ValueError: an anchor ``>= n_anchors`` on CPU inputs; on a GPU the same check runs on the
            device (``torch._assert_async``, a device-side assert with this message), since reading
            it on the host would be the sync this argument avoids.
    """
    dev = anchor.device
    sup = (weight > 0) & in_vocab
    ok = correct & sup
    n = n_anchors if n_anchors is not None else (int(anchor.max()) + 1 if anchor.numel() else 1)
    if n_anchors is not None and anchor.numel():
        msg = f"depth_stats: an anchor is >= n_anchors={n}"
        if dev.type == "cpu":
            if int(anchor.max()) >= n:
                raise ValueError(msg)
        else:  # checked on the device: no host sync
            torch._assert_async(anchor.max() < n, msg)
    in_range = depth < K
    d_at = torch.where(in_range, depth, torch.zeros_like(depth))
    acc_num = torch.zeros(K, dtype=torch.float64, device=dev).index_add_(0, d_at, (ok & in_range).double())
    acc_den = torch.zeros(K, dtype=torch.float64, device=dev).index_add_(0, d_at, (sup & in_range).double())
    # per-anchor tables [n, K]: (anchor, depth) correct / supervised, OR over repeated elements
    slot = torch.where(in_range, anchor * K + depth, torch.full_like(anchor, n * K))  # others → a dummy slot

    def table(x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(n * K + 1, dtype=torch.uint8, device=dev)
        return z.scatter_reduce_(0, slot, x.to(torch.uint8), reduce="amax")[:-1].view(n, K).bool()

    ok_t, sup_t = table(ok), table(sup)
    chain_ok = ok_t.int().cummin(1).values.bool()  # [n, K]: every depth <= d correct
    given = chain_ok[:, :-1] & sup_t[:, 1:]  # depth d >= 1 supervised after a correct chain up to d - 1
    cond_num = torch.cat([acc_num[:1], (given & ok_t[:, 1:]).sum(0).double()])
    cond_den = torch.cat([acc_den[:1], given.sum(0).double()])
    rows = torch.stack([acc_num, acc_den, cond_num, cond_den])
    return DepthStats(*rows.unbind(0))
