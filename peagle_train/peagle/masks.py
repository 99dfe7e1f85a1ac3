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

Split form (``train.attention: flex``): the rule is the disjoint union of

* the **prefix** ``dk == 0 and ak <= aq`` (the causal depth-0 context, own anchor
  included), and
* the **chain** ``ak == aq and 1 <= dk <= dq`` (at most ``C = K - 1`` keys per query),

both within one document. In the example above the prefix is the depth-0 columns
and the chain is the ``(1,1)``/``(1,2)`` columns. The prefix is a near-causal block
pattern over the contiguous depth-0 keys of the depth-major grid (few partial
blocks: :func:`build_block_mask` with ``part="prefix"``); the chain is a per-query
gather of at most ``C`` keys (:func:`build_chain_index`, :func:`chain_attention`).
The two softmax parts are merged exactly by log-sum-exp (:func:`merge_by_lse`).
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


def allowed_prefix(qa, qd, qdoc, ka, kd, kdoc):
    """Prefix part of the rule: same document and ``dk == 0 and ak <= aq`` (bool, broadcast; int
    tensors of any broadcastable shape). Source: PEAGLE_SPEC §3, split as in the module docstring."""
    return (qdoc == kdoc) & (qdoc >= 0) & (kd == 0) & (ka <= qa)


def allowed_chain(qa, qd, qdoc, ka, kd, kdoc):
    """Chain part of the rule: same document and ``ak == aq and 1 <= dk <= dq`` (bool, broadcast).

    Disjoint from :func:`allowed_prefix` (``dk >= 1`` vs ``dk == 0``); their union is :func:`allowed`.
    Source: PEAGLE_SPEC §3, split as in the module docstring.
    """
    return (qdoc == kdoc) & (qdoc >= 0) & (ka == qa) & (kd >= 1) & (kd <= qd)


_RULES = {"all": allowed, "prefix": allowed_prefix, "chain": allowed_chain}


def _rule(part: str):
    if part not in _RULES:
        raise ValueError(f"unknown rule part {part!r}; expected one of {sorted(_RULES)}")
    return _RULES[part]


def dense_mask(q: GridMeta, kv: GridMeta | None = None, part: str = "all") -> torch.Tensor:
    """Dense reference mask ``[E_q, E_kv]`` bool. For tests and tiny inputs only.

    ``part``: ``"all"`` (the whole rule), ``"prefix"`` or ``"chain"`` (the two disjoint parts of the
    split form, see the module docstring).
    """
    kv = q if kv is None else kv
    return _rule(part)(
        q.anchor[:, None], q.depth[:, None], q.doc[:, None], kv.anchor[None, :], kv.depth[None, :], kv.doc[None, :]
    )


def make_mask_mod(q: GridMeta, kv: GridMeta, part: str = "all"):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for the grid rule (or one ``part`` of it,
    as :func:`dense_mask`).

    ``q``/``kv`` must already be padded to the block-mask lengths so that every
    index the kernel evaluates is in range.
    """
    rule = _rule(part)
    qa, qd, qdoc = q.anchor, q.depth, q.doc
    ka, kd, kdoc = kv.anchor, kv.depth, kv.doc

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(qa[q_idx], qd[q_idx], qdoc[q_idx], ka[kv_idx], kd[kv_idx], kdoc[kv_idx])

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
        "d0_doc_min": torch.where(d0, doc, big).amin(1),
        "d0_doc_max": torch.where(d0, doc, small).amax(1),
    }


def block_structure(q: GridMeta, kv: GridMeta, block_size: int = 128, part: str = "all"):
    """Which ``(q_block, kv_block)`` pairs may hold an allowed pair, and which are full.

    Inputs must be padded to a multiple of ``block_size``. ``partial`` is a
    superset of the blocks with any allowed pair (necessary conditions of the
    rule); ``full`` is a subset of the blocks where every pair is allowed
    (sufficient condition: single shared document, no padding, all keys depth 0
    with ``max key anchor <= min query anchor``). ``part="prefix"`` describes the
    prefix part only (``dk == 0 and ak <= aq``, same document): blocks of keys
    without a depth-0 element are empty, which in the depth-major layout is every
    block past the depth-0 keys. The full condition is the same for both parts.

    Returns:
        ``(partial, full)``: bool ``[nQB, nKB]`` each, ``partial & ~full`` already applied.

    Raises:
        ValueError: ``part`` other than ``"all"`` / ``"prefix"``.
    """
    if part not in ("all", "prefix"):
        raise ValueError(f"block_structure: part must be 'all' or 'prefix', got {part!r}")
    sq, sk = _block_summary(q, block_size), _block_summary(kv, block_size)
    Q = {k: v[:, None] for k, v in sq.items()}
    Kv = {k: v[None, :] for k, v in sk.items()}
    prefix = Kv["d0_any"] & (Kv["d0_a_min"] <= Q["a_max"])
    if part == "prefix":
        d0_docs_overlap = (Q["doc_min"] <= Kv["d0_doc_max"]) & (Kv["d0_doc_min"] <= Q["doc_max"])
        possible = Q["any"] & d0_docs_overlap & prefix
    else:
        docs_overlap = (Q["doc_min"] <= Kv["doc_max"]) & (Kv["doc_min"] <= Q["doc_max"])
        chain = (Q["a_min"] <= Kv["a_max"]) & (Kv["a_min"] <= Q["a_max"]) & (Kv["d_min"] <= Q["d_max"])
        possible = Q["any"] & Kv["any"] & docs_overlap & (prefix | chain)
    single_doc = (Q["doc_min"] == Q["doc_max"]) & (Kv["doc_min"] == Kv["doc_max"]) & (Q["doc_min"] == Kv["doc_min"])
    full = Q["all"] & Kv["all"] & single_doc & Kv["d0_all"] & (Kv["a_max"] <= Q["a_min"])
    return possible & ~full, full


def _to_indices(blocks: torch.Tensor):
    num = blocks.sum(-1).to(torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


def build_block_mask(q: GridMeta, kv: GridMeta | None = None, block_size: int = 128, part: str = "all"):
    """FlexAttention ``BlockMask`` for the grid rule, without a dense ``E_q × E_kv`` tensor.

    Args:
        q: query metadata (``[E_q]``). kv: key metadata (``[E_kv]``); ``None`` = same as ``q``.
        block_size: kernel block size (128 for the default kernels).
        part: ``"all"`` (the whole rule, one kernel) or ``"prefix"`` (the prefix part of the split
            form; the chain part is :func:`build_chain_index`).

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
    partial, full = block_structure(qp, kp, block_size, part)
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=make_mask_mod(qp, kp, part),
        seq_lengths=(lq, lk),
    )


_DEPTH_BITS = 20  # composite key anchor * 2**20 + depth: depths < 2**20, anchors < 2**43


def build_chain_index(q: GridMeta, kv: GridMeta | None = None, min_chain: int = 0,
                      max_depth: int | None = None):
    """Per query, the keys of its own chain at depths ``1..dq`` (the chain part of the rule).

    Slot ``j - 1`` of query ``(aq, dq, docq)`` holds the key ``(aq, j)``; it is valid iff
    ``1 <= j <= dq``, that key exists among ``kv``, it is in the query's document and the query
    is not padding (``docq >= 0``). Works for any key order (depth-major grids, partition
    segments, EAGLE-3's concatenated TTT steps): the real keys of depth >= 1 are sorted by the
    composite key ``anchor * 2**20 + depth`` and looked up with ``searchsorted``; no Python
    loop over elements, no ``E_q × E_kv`` tensor. One host sync (the chain width and the
    duplicate check below), or none when ``max_depth`` is given.

    Args:
        q: query metadata (``[E_q]``). kv: key metadata (``[E_kv]``, ``E_kv >= 1``); ``None`` = ``q``.
        min_chain: at least this many slots (``K - 1`` gives every micro-batch the same shape, so a
            compiled layer is not recompiled when a COD sample happens to drop the deepest depths).
        max_depth: the deepest depth the grid can hold (``K - 1`` for a K-depth grid), known on the
            host. Then ``C = max(min_chain, max_depth)`` without reading the depths back, and the
            checks below run on the device (``torch._assert_async``: on CUDA a failed check is a
            device-side assert that ends the process at the next sync; recent torch builds print
            the message below with it, older ones a generic "device-side assert triggered"; on
            CPU it raises at once). The checks guard against a bug in grid construction, not
            against user data (validated before any grid is built); training checkpoints are
            written atomically, so an abort loses only the current step. None: the checks and
            the chain width read one host sync.

    Returns:
        ``(index, valid)``: ``index [E_q, C]`` int64 rows of ``kv`` (0 where invalid) and
        ``valid [E_q, C]`` bool, ``C = max(min_chain, deepest real query depth)`` (with
        ``max_depth``: ``max(min_chain, max_depth)``).

    Raises:
        ValueError: no keys; depth ``>= 2**20``; or a real ``(anchor, depth >= 1)`` key occurring
            twice in ``kv`` (the chain would be ambiguous). With ``max_depth``: RuntimeError for
            those two, and for a real query deeper than ``max_depth`` (CPU: at once; CUDA: see
            above).

    Source: PEAGLE_SPEC §3 (attention rule), split as in this module's docstring.
    """
    kv = q if kv is None else kv
    if len(kv) == 0:
        raise ValueError("build_chain_index: no keys")
    dev = kv.anchor.device
    q_real = q.doc >= 0
    k_chain = (kv.doc >= 0) & (kv.depth >= 1)
    code = torch.where(k_chain, (kv.anchor << _DEPTH_BITS) + kv.depth, torch.full_like(kv.anchor, -1))
    sorted_code, order = torch.sort(code)
    dup = ((sorted_code[1:] == sorted_code[:-1]) & (sorted_code[1:] >= 0)).any()
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    deepest = torch.where(q_real, q.depth, zero).amax() if len(q) else zero
    too_deep = torch.maximum(deepest, torch.where(k_chain, kv.depth, zero).amax()) >= (1 << _DEPTH_BITS)
    if max_depth is not None:  # no host sync: the checks run on the device
        torch._assert_async(~too_deep, f"build_chain_index: depths must be < 2**{_DEPTH_BITS}")
        torch._assert_async(~dup, "build_chain_index: a (anchor, depth >= 1) key occurs twice among the keys")
        torch._assert_async(deepest <= max_depth, f"build_chain_index: a query is deeper than max_depth={max_depth}")
        C = max(int(min_chain), int(max_depth))
    else:
        deepest, dup, too_deep = torch.stack([deepest, dup.long(), too_deep.long()]).tolist()  # the one host sync
        if too_deep:
            raise ValueError(f"build_chain_index: depths must be < 2**{_DEPTH_BITS}")
        if dup:
            raise ValueError("build_chain_index: a (anchor, depth >= 1) key occurs twice among the keys")
        C = max(int(min_chain), deepest)
    j = torch.arange(1, C + 1, device=dev)  # [C] depths looked up
    want = (q.anchor[:, None] << _DEPTH_BITS) + j[None, :]  # [E_q, C]
    pos = torch.searchsorted(sorted_code, want).clamp(max=len(kv) - 1)
    found = sorted_code[pos] == want
    index = order[pos]
    valid = found & (j[None, :] <= q.depth[:, None]) & q_real[:, None] & (kv.doc[index] == q.doc[:, None])
    return torch.where(valid, index, torch.zeros_like(index)), valid


@dataclass
class SplitMasks:
    """The split form of the rule for one (queries, keys) pair, built once per grid (outside the layers).

    Attributes:
        prefix_mask: FlexAttention ``BlockMask`` of the prefix part (``seq_lengths = (E_q, E_kv)``).
        chain_index: ``[E_q, C]`` int64 key rows of each query's chain (:func:`build_chain_index`).
        chain_valid: ``[E_q, C]`` bool.
        chain_inverse, chain_inverse_valid: ``[E_kv, C]`` (:func:`invert_chain_index`): the
            deterministic backward of the chain gather.
        chain_kernel: ``"torch"`` (:func:`chain_attention` in PyTorch) or ``"triton"`` (the kernels of
            :mod:`peagle_train.kernels.chain_kernel`); same math.
        prefix_kernel_options: FlexAttention ``kernel_options`` of the prefix part as sorted ``(name, value)``
            pairs (hashable: a compiled layer sees a constant), or ``None`` for its own choice: the options that
            run, ``train.prefix_kernel_options`` resolved for the grid's device (``"auto"`` never stays here;
            :func:`peagle_train.kernels.attention.prefix_kernel_options_for`).
        prefix_kernel_options_auto: True where those options come from ``auto``: then they apply only to a
            layer whose head dimension and dtype :func:`peagle_train.kernels.attention.auto_block_fits`.
        prefix_compiled_apart: ``train.prefix_compiled_apart``: inside a compiled layer the prefix part runs as its own
            compiled FlexAttention behind a graph break instead of in the layer's graph (same math).
    """

    prefix_mask: object
    chain_index: torch.Tensor
    chain_valid: torch.Tensor
    chain_inverse: torch.Tensor  # [E_kv, C] int64, see invert_chain_index
    chain_inverse_valid: torch.Tensor  # [E_kv, C] bool
    chain_kernel: str = "torch"  # "torch" or "triton": how chain_attention runs (chain_kernel.resolve)
    prefix_kernel_options: tuple[tuple[str, bool | int], ...] | None = None
    prefix_kernel_options_auto: bool = False
    prefix_compiled_apart: bool = False


def invert_chain_index(index: torch.Tensor, valid: torch.Tensor, n_kv: int, sync_check: bool = True):
    """Which ``(query, slot)`` pairs read each key row: the transpose of a chain index.

    A key ``(a, j)`` is read only in slot ``j - 1`` of the queries ``(a, i)``, ``i >= j``, so at most
    ``C`` pairs read it. The chain gather's backward sums over them with a gather
    (:func:`chain_gather`) instead of an ``index_add`` (atomic, non-deterministic on CUDA; 23 ms
    of a 366 ms GPT-OSS-20B step on an H200, ``docs/benchmarks.md``).

    Args:
        index: ``[E_q, C]`` int64 key rows; valid: ``[E_q, C]`` bool (:func:`build_chain_index`).
        n_kv: number of key rows ``E_kv``.
        sync_check: check the input with a host sync (ValueError); False: on the device
            (``torch._assert_async``, see :func:`build_chain_index`'s ``max_depth``).

    Returns:
        ``(inverse [E_kv, C]`` int64 flat positions ``q_row * C + slot`` into ``index``, 0 where
        unused, ``inverse_valid [E_kv, C]`` bool``)``; every valid ``(q_row, slot)`` appears exactly
        once, in the row of its key.

    Raises:
        ValueError: a key read by more than ``C`` pairs (not a chain index); RuntimeError with
            ``sync_check=False`` (CPU: at once; CUDA: a device-side assert).
    """
    Eq, C = index.shape
    dev = index.device
    flat_key = torch.where(valid, index, torch.full_like(index, n_kv)).reshape(-1)  # invalid -> dummy row
    key_sorted, order = torch.sort(flat_key, stable=True)
    first = torch.searchsorted(key_sorted, key_sorted)  # start of each key's run
    rank = torch.arange(key_sorted.numel(), device=dev) - first
    if C:
        over = ((rank >= C) & (key_sorted < n_kv)).any()
        msg = f"invert_chain_index: a key is read by more than C={C} (query, slot) pairs"
        if not sync_check:
            torch._assert_async(~over, msg)
        elif bool(over):  # one host sync
            raise ValueError(msg)
    keep = (key_sorted < n_kv) & (rank < C)
    slot = torch.where(keep, key_sorted * C + rank, torch.full_like(rank, n_kv * C))  # dummy slot at the end
    inverse = torch.zeros(n_kv * C + 1, dtype=torch.int64, device=dev).scatter_(0, slot, order)
    inverse_valid = torch.zeros(n_kv * C + 1, dtype=torch.bool, device=dev).scatter_(0, slot, keep)
    return inverse[:-1].view(n_kv, C), inverse_valid[:-1].view(n_kv, C)
