"""The flattened N×K training grid and COD position sampling (spec §3). Pure tensors.

Shape legend: ``N`` tokens in one packed micro-batch (several documents, possibly
padding), ``K`` parallel depths, ``E`` kept grid elements.

Worked example (one document, N = 6, all positions loss-valid from index 2,
K = 3, r = 1 so nothing is dropped)::

    tokens x0 x1 x2 x3 x4 x5
    depth 0: anchors 0..4  (element (a,0) reads emb(x[a+1]) + h[a], position a)
             supervised for a = 0..3 (label row a+1 predicts x[a+2])
    depth 1: anchors 0..2  (emb(MASK) + mask_hidden, position a+1, label row a+2)
    depth 2: anchors 0..1  (position a+2, label row a+3)

Elements are laid out **depth-major** (all depth-0 elements by anchor, then
depth 1, ...), which keeps each depth block's attention to depth 0 causal
(PERF_NOTES lead 1). The attention rule itself does not depend on the order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from peagle_train.core.device import to_device  # noqa: F401  (re-exported: grid.to() uses it)


@dataclass
class Grid:
    """Flat ``(anchor, depth)`` elements of one packed micro-batch. All tensors ``[E]``.

    Attributes:
        anchor: int64, index of the anchor token in the packed sequence.
        depth: int64 in ``[0, K)``.
        doc: int64 document id of the anchor (>= 0; padding never forms elements).
        position_ids: int64 RoPE position ``(anchor - doc_start) + depth`` (spec §3).
        token_ids: int64 input token: ``x[anchor+1]`` at depth 0, ``mask_token_id`` above.
        hidden_index: int64 row of the aux states fed with the element: ``anchor`` at
            depth 0, ``-1`` (= ``mask_hidden``) above.
        label_index: int64 row of the target's next-token distribution the element is
            trained on: ``anchor + 1 + depth`` (predicts ``x[anchor + 2 + depth]``);
            clamped to ``N - 1`` where the element carries no loss.
        loss_weight: float32, 1 for supervised elements, 0 for context-only ones.
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor
    position_ids: torch.Tensor
    token_ids: torch.Tensor
    hidden_index: torch.Tensor
    label_index: torch.Tensor
    loss_weight: torch.Tensor

    def __len__(self) -> int:
        return int(self.anchor.numel())

    def select(self, index: torch.Tensor) -> "Grid":
        """Sub-grid of the elements ``index`` (int64 ``[E']``, order kept)."""
        return Grid(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device, non_blocking: bool = False) -> "Grid":
        """The grid on ``device``. ``non_blocking``: a CPU grid going to a GPU is copied through pinned
        memory without making the host wait (the step's grid is built on the CPU, as the data loader
        has the tokens there, so the GPU never idles for it)."""
        return Grid(**{f.name: to_device(getattr(self, f.name), device, non_blocking) for f in fields(self)})


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Index of the first token of each token's document.

    Args:
        doc_ids: ``[N]`` int64, non-decreasing over real tokens, ``-1`` for padding.

    Returns:
        ``[N]`` int64 ``start[i]`` = smallest ``j`` with ``doc_ids[j] == doc_ids[i]``.
    """
    n = doc_ids.numel()
    idx = torch.arange(n, device=doc_ids.device)
    new = torch.ones(n, dtype=torch.bool, device=doc_ids.device)
    new[1:] = doc_ids[1:] != doc_ids[:-1]
    start_marks = torch.where(new, idx, torch.zeros_like(idx))
    return torch.cummax(start_marks, dim=0).values


def valid_at_depth(loss_mask: torch.Tensor, doc_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """Which anchors carry a supervised element at ``depth``.

    ``(a, d)`` is supervised iff ``x[a+2+d]`` exists, lies in ``a``'s document,
    is not padding, and is a loss-masked (assistant) token.

    Args:
        loss_mask: ``[N]`` bool. doc_ids: ``[N]`` int64 (-1 = padding). depth: ``d >= 0``.

    Returns:
        ``[N]`` bool over anchors.
    """
    n = loss_mask.numel()
    s = 2 + depth
    out = torch.zeros(n, dtype=torch.bool, device=loss_mask.device)
    if n > s:
        out[: n - s] = loss_mask[s:] & (doc_ids[s:] == doc_ids[: n - s]) & (doc_ids[: n - s] >= 0)
    return out


def cod_fraction(d: int, r: float, r_min: float) -> float:
    """Fraction of the valid anchors COD keeps at depth ``d``: 1 at depth 0, else ``max(r**d, r_min)``
    (spec §3, PARD arXiv 2504.18583)."""
    return 1.0 if d == 0 else max(r**d, r_min)


def cod_keep_counts(n_valid: int, K: int, r: float, r_min: float, max_anchors: int | None) -> list[int]:
    """Target element counts per depth for COD (spec §3, PARD arXiv 2504.18583).

    Depth 0 keeps ``n_valid``; depth ``d >= 1`` keeps
    ``floor(n_valid * max(r**d, r_min))``, capped by ``max_anchors``.
    """
    counts = [n_valid]
    for d in range(1, K):
        c = math.floor(n_valid * cod_fraction(d, r, r_min))
        if max_anchors is not None:
            c = min(c, max_anchors)
        counts.append(c)
    return counts


def cod_sample(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    K: int,
    r: float,
    r_min: float,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Conditional drop-token sampling of the anchors kept at each depth.

    Depth ``d >= 1`` samples uniformly without replacement among anchors kept at
    depth ``d-1`` whose depth-``d`` element is supervised; so every kept chain is
    complete and never crosses a document. The count is
    ``min(cod_keep_counts(...)[d], #candidates)``.

    Args:
        loss_mask: ``[N]`` bool. doc_ids: ``[N]`` int64 (-1 padding). K: depths (>= 1).
        r, r_min: COD decay and floor. max_anchors: cap on chains (depth >= 1 counts).
        generator: CPU ``torch.Generator`` for reproducibility.

    Returns:
        ``K`` sorted int64 tensors of kept anchors on the CPU (depth 0 = all supervised anchors).

    Raises:
        ValueError: ``K < 1``.
    """
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    loss_mask = loss_mask.bool().cpu()
    doc_ids = doc_ids.cpu()
    kept_mask = valid_at_depth(loss_mask, doc_ids, 0)
    kept = [kept_mask.nonzero().flatten()]
    counts = cod_keep_counts(int(kept_mask.sum()), K, r, r_min, max_anchors)
    for d in range(1, K):
        cand = (kept_mask & valid_at_depth(loss_mask, doc_ids, d)).nonzero().flatten()
        c = min(counts[d], cand.numel())
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:c]].sort().values
        kept_mask = torch.zeros_like(kept_mask)
        kept_mask[pick] = True
        kept.append(pick)
    return kept


def build_grid(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor,
    kept: list[torch.Tensor],
    mask_token_id: int,
) -> Grid:
    """Lay out the grid depth-major from a COD sample.

    Depth 0 holds one element for *every* anchor that has a next token in its
    document (context for all chains), supervised where :func:`valid_at_depth`
    says so; depths ``>= 1`` hold exactly the kept anchors, all supervised.

    Args:
        input_ids: ``[N]`` int64. loss_mask: ``[N]`` bool. doc_ids: ``[N]`` int64 (-1 padding).
        kept: output of :func:`cod_sample` (``kept[0]`` is ignored: depth 0 is all anchors).
        mask_token_id: the reserved mask token (spec §2).

    Returns:
        :class:`Grid` on the device of ``input_ids``.
    """
    dev = input_ids.device
    n = input_ids.numel()
    loss_mask = loss_mask.bool()
    has_next = torch.zeros(n, dtype=torch.bool, device=dev)
    if n > 1:
        has_next[:-1] = (doc_ids[1:] == doc_ids[:-1]) & (doc_ids[:-1] >= 0)
    a0 = has_next.nonzero().flatten()
    # one host→device copy for all depths >= 1 (sizes are known on the host), not K - 1
    deeper = list(torch.cat([k.reshape(-1).cpu() for k in kept[1:]]).to(dev).split([k.numel() for k in kept[1:]])) \
        if len(kept) > 1 else []
    anchors = [a0] + deeper
    depth = torch.cat([torch.full_like(a, d) for d, a in enumerate(anchors)])
    anchor = torch.cat(anchors)
    start = doc_starts(doc_ids)
    w0 = valid_at_depth(loss_mask, doc_ids, 0)[a0]
    weight = torch.cat([w0.float()] + [torch.ones(a.numel(), device=dev) for a in anchors[1:]])
    token0 = input_ids[a0 + 1]
    token_ids = torch.cat([token0] + [torch.full_like(a, mask_token_id) for a in anchors[1:]])
    hidden_index = torch.where(depth == 0, anchor, torch.full_like(anchor, -1))
    label_index = torch.clamp(anchor + 1 + depth, max=n - 1)
    return Grid(
        anchor=anchor,
        depth=depth,
        doc=doc_ids[anchor],
        position_ids=anchor - start[anchor] + depth,
        token_ids=token_ids,
        hidden_index=hidden_index,
        label_index=label_index,
        loss_weight=weight,
    )


def pad_grid(grid: Grid, multiple: int, length: int | None = None) -> Grid:
    """Append padding elements so ``len`` is a multiple of ``multiple`` (bucketed shapes avoid
    recompiling the fused attention kernel for every COD sample size), or exactly ``length``.

    Padding elements have ``doc = -1`` (they attend to nothing and nothing attends to them,
    see :mod:`peagle_train.peagle.masks`), ``loss_weight = 0`` and valid indices (row 0).

    Args:
        grid: ``E`` elements. multiple: bucket size (``1`` = no padding); ignored when ``length``
            is given. length: the exact padded length (``>= E``), e.g. EAGLE-3's per-step lengths.

    Raises:
        ValueError: ``length`` shorter than the grid.
    """
    if length is not None and length < len(grid):
        raise ValueError(f"pad_grid: length {length} is shorter than the grid ({len(grid)} elements)")
    extra = (-len(grid)) % multiple if length is None else length - len(grid)
    if extra == 0:
        return grid
    dev = grid.anchor.device
    z = torch.zeros(extra, dtype=torch.int64, device=dev)
    return Grid(
        anchor=torch.cat([grid.anchor, z]), depth=torch.cat([grid.depth, z]),
        doc=torch.cat([grid.doc, z - 1]), position_ids=torch.cat([grid.position_ids, z]),
        token_ids=torch.cat([grid.token_ids, z]), hidden_index=torch.cat([grid.hidden_index, z]),
        label_index=torch.cat([grid.label_index, z]),
        loss_weight=torch.cat([grid.loss_weight, torch.zeros(extra, dtype=grid.loss_weight.dtype, device=dev)]),
    )


def supervised_count(grid: Grid) -> int:
    """Number of supervised elements (the loss normaliser of one sequence)."""
    return int((grid.loss_weight > 0).sum())
