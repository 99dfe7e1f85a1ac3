"""The P-EAGLE grid attention rule as a FlexAttention ``mask_mod`` and ``BlockMask`` (spec §3).

Rule: query ``(aq, dq)`` may attend key ``(ak, dk)`` iff both are in the same
document (not padding) and ``(dk == 0 and ak <= aq) or (ak == aq and dk <= dq)``.

Worked example (one document, anchors 0..2 at depth 0, chain of anchor 1 at depths 1, 2;
depth-major order ``[(0,0) (1,0) (2,0) (1,1) (1,2)]``)::

              (0,0) (1,0) (2,0) (1,1) (1,2)
      (0,0)     1     .     .     .     .
      (1,0)     1     1     .     .     .
      (2,0)     1     1     1     .     .
      (1,1)     1     1     .     1     .
      (1,2)     1     1     .     1     1

which is exactly vLLM's causal attention over ``[context..., bonus, MASK, MASK]``
(spec §4). The block mask is built from per-block summaries (``O(blocks²)``
work), never from an ``(E_q × E_kv)`` dense tensor; partially covered blocks
are refined by the ``mask_mod`` inside the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GridMeta:
    """Per-element metadata the attention rule needs. All ``[E]`` int64; ``doc = -1`` is padding."""

    anchor: torch.Tensor
    depth: torch.Tensor
    doc: torch.Tensor

    @classmethod
    def of(cls, grid) -> "GridMeta":
        return cls(grid.anchor, grid.depth, grid.doc)

    def __len__(self) -> int:
        return int(self.anchor.numel())

    def padded(self, length: int) -> "GridMeta":
        """Pad to ``length`` with padding elements (doc = -1)."""
        extra = length - len(self)
        if extra <= 0:
            return self
        pad = lambda t, v: torch.cat([t, t.new_full((extra,), v)])  # noqa: E731
        return GridMeta(pad(self.anchor, 0), pad(self.depth, 0), pad(self.doc, -1))


def allowed(qa, qd, qdoc, ka, kd, kdoc):
    """Elementwise attention rule on broadcastable int tensors; returns bool."""
    same = (qdoc == kdoc) & (qdoc >= 0)
    prefix = (kd == 0) & (ka <= qa)
    chain = (ka == qa) & (kd <= qd)
    return same & (prefix | chain)


def dense_mask(q: GridMeta, kv: GridMeta | None = None) -> torch.Tensor:
    """Dense reference mask ``[E_q, E_kv]`` bool. For tests and tiny inputs only."""
    kv = q if kv is None else kv
    return allowed(
        q.anchor[:, None], q.depth[:, None], q.doc[:, None], kv.anchor[None, :], kv.depth[None, :], kv.doc[None, :]
    )


def make_mask_mod(q: GridMeta, kv: GridMeta):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for the grid rule.

    ``q``/``kv`` must already be padded to the block-mask lengths so that every
    index the kernel evaluates is in range.
    """
    qa, qd, qdoc = q.anchor, q.depth, q.doc
    ka, kd, kdoc = kv.anchor, kv.depth, kv.doc

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(qa[q_idx], qd[q_idx], qdoc[q_idx], ka[kv_idx], kd[kv_idx], kdoc[kv_idx])

    return mask_mod


def _block_summary(m: GridMeta, bs: int):
    nb = len(m) // bs
    a = m.anchor.view(nb, bs)
    d = m.depth.view(nb, bs)
    doc = m.doc.view(nb, bs)
    real = doc >= 0
    big = torch.iinfo(torch.int64).max
    small = torch.iinfo(torch.int64).min
    d0 = real & (d == 0)
    return {
        "any": real.any(1),
        "all": real.all(1),
        "doc_min": torch.where(real, doc, big).amin(1),
        "doc_max": torch.where(real, doc, small).amax(1),
        "a_min": torch.where(real, a, big).amin(1),
        "a_max": torch.where(real, a, small).amax(1),
        "d_min": torch.where(real, d, big).amin(1),
        "d_max": torch.where(real, d, small).amax(1),
        "d0_any": d0.any(1),
        "d0_all": (d0 | ~real).all(1) & real.any(1),
        "d0_a_min": torch.where(d0, a, big).amin(1),
    }


def block_structure(q: GridMeta, kv: GridMeta, block_size: int = 128):
    """Which ``(q_block, kv_block)`` pairs may hold an allowed pair, and which are full.

    Inputs must be padded to a multiple of ``block_size``. ``partial`` is a
    superset of the blocks with any allowed pair (necessary conditions of the
    rule); ``full`` is a subset of the blocks where every pair is allowed
    (sufficient condition: single shared document, no padding, all keys depth 0
    with ``max key anchor <= min query anchor``).

    Returns:
        ``(partial, full)``: bool ``[nQB, nKB]`` each, ``partial & ~full`` already applied.
    """
    sq, sk = _block_summary(q, block_size), _block_summary(kv, block_size)
    Q = {k: v[:, None] for k, v in sq.items()}
    Kv = {k: v[None, :] for k, v in sk.items()}
    docs_overlap = (Q["doc_min"] <= Kv["doc_max"]) & (Kv["doc_min"] <= Q["doc_max"])
    prefix = Kv["d0_any"] & (Kv["d0_a_min"] <= Q["a_max"])
    chain = (Q["a_min"] <= Kv["a_max"]) & (Kv["a_min"] <= Q["a_max"]) & (Kv["d_min"] <= Q["d_max"])
    possible = Q["any"] & Kv["any"] & docs_overlap & (prefix | chain)
    single_doc = (Q["doc_min"] == Q["doc_max"]) & (Kv["doc_min"] == Kv["doc_max"]) & (Q["doc_min"] == Kv["doc_min"])
    full = Q["all"] & Kv["all"] & single_doc & Kv["d0_all"] & (Kv["a_max"] <= Q["a_min"])
    return possible & ~full, full


def _to_indices(blocks: torch.Tensor):
    num = blocks.sum(-1).to(torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


def build_block_mask(q: GridMeta, kv: GridMeta | None = None, block_size: int = 128):
    """FlexAttention ``BlockMask`` for the grid rule, without a dense ``E_q × E_kv`` tensor.

    Args:
        q: query metadata (``[E_q]``). kv: key metadata (``[E_kv]``); ``None`` = same as ``q``.
        block_size: kernel block size (128 for the default kernels).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` with ``seq_lengths = (E_q, E_kv)``,
        batch and head dimensions of size 1 (broadcast).
    """
    from torch.nn.attention.flex_attention import BlockMask

    kv = q if kv is None else kv
    lq, lk = len(q), len(kv)
    pq = -(-lq // block_size) * block_size
    pk = -(-lk // block_size) * block_size
    qp, kp = q.padded(pq), kv.padded(pk)
    partial, full = block_structure(qp, kp, block_size)
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=make_mask_mod(qp, kp),
        seq_lengths=(lq, lk),
    )
