"""Sequence partitioning: exact gradient accumulation inside one sequence (spec §3, Algorithm 1).

For ``S`` segments with boundaries ``B_s = floor(s * N / S)``:

1. one COD sample (one :class:`~peagle_train.peagle.grid.Grid`) shared by all segments;
2. depth-0 and depth-1 elements belong to ``seg(a + d)`` with
   ``seg(p) = max{s : B_s <= p}``;
3. depth ``>= 2`` elements inherit the segment of their chain's depth-1 element,
   i.e. ``seg(a + 1)``;
4. segment ``s`` also receives every depth-0 element with anchor ``< B_{s+1}`` as
   key/value-only context (recomputed, no loss);
5. each segment's loss is divided by the supervised count of the whole sequence
   (or global batch), so segment losses sum to the unpartitioned loss.

Worked example: ``N = 8``, ``S = 2`` → ``B = [0, 4, 8]``. Element ``(5, 0)`` is owned
by segment 1; ``(2, 1)`` (position 3) by segment 0; ``(3, 2)`` follows ``(3, 1)``
(position 4) into segment 1, which also sees depth-0 anchors 0..3 as context.

Every key an owned element attends to (its depth-0 prefix, its own chain) is
present in its segment, and depth-0 outputs depend only on the depth-0 prefix,
so each owned element's loss is computed exactly as in the full grid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_train.core.device import to_device
from peagle_train.peagle.grid import Grid


@dataclass
class Segment:
    """One partition segment.

    Attributes:
        index: ``[E_s]`` int64 indices into the full grid, increasing (keeps depth-major order).
        owned: ``[E_s]`` bool, True where this segment supervises the element
            (False = key/value-only depth-0 context).
    """

    index: torch.Tensor
    owned: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "Segment":
        """The segment on ``device`` (see :meth:`Grid.to`)."""
        return Segment(to_device(self.index, device, non_blocking), to_device(self.owned, device, non_blocking))

    def apply(self, grid: Grid) -> Grid:
        """Sub-grid with loss weights zeroed on context-only elements."""
        sub = grid.select(self.index)
        sub.loss_weight = sub.loss_weight * self.owned.to(sub.loss_weight.dtype)
        return sub


def segment_boundaries(n_tokens: int, S: int) -> torch.Tensor:
    """``B_s = floor(s * N / S)`` for ``s = 0..S`` (int64 ``[S+1]``).

    Raises:
        ValueError: ``S < 1`` or ``S > N``.
    """
    if S < 1 or S > max(n_tokens, 1):
        raise ValueError(f"partitions S={S} must be in [1, N={n_tokens}]")
    return torch.tensor([(s * n_tokens) // S for s in range(S + 1)], dtype=torch.int64)


def owner_segment(grid: Grid, n_tokens: int, S: int) -> torch.Tensor:
    """Owning segment of every element, ``[E]`` int64 (rules 2-3 above)."""
    b = segment_boundaries(n_tokens, S).to(grid.anchor.device)
    p = torch.where(grid.depth == 0, grid.anchor, grid.anchor + 1)
    return torch.searchsorted(b, p, right=True) - 1


def plan_partitions(grid: Grid, n_tokens: int, S: int) -> list[Segment]:
    """Split a grid into ``S`` segments (rules 1-4 above).

    Args:
        grid: full grid of a packed sequence of ``n_tokens`` tokens.
        n_tokens: ``N``. S: number of segments.

    Returns:
        ``S`` :class:`Segment` s; every supervised element is owned by exactly one.
    """
    dev = grid.anchor.device
    b = segment_boundaries(n_tokens, S).to(dev)
    owner = owner_segment(grid, n_tokens, S)
    is_d0 = grid.depth == 0
    seg = torch.arange(S, device=dev)[:, None]
    owned = owner[None, :] == seg  # [S, E]
    keep = owned | (is_d0[None, :] & (grid.anchor[None, :] < b[:S, None]))
    # one device→host copy for all segments (nonzero per segment would sync S times)
    keep_host = keep.cpu()
    segments = []
    for s in range(S):
        index = keep_host[s].nonzero().flatten().to(dev, non_blocking=True)
        segments.append(Segment(index=index, owned=owned[s][index]))
    return segments
