"""Training objectives as ``nn.Module`` s whose ``forward`` returns ``(loss, draft_pred)``.

The loss lives inside ``forward`` so DDP / FSDP2 / DeepSpeed wrap one module and
their hooks see every parameter use. Both objectives share the drafter code:

* :class:`PEagleObjective` — one forward over the whole (or one segment of the)
  flattened N×K grid (spec §3).
* :class:`Eagle3Objective` — the autoregressive EAGLE-3 baseline with
  training-time test (TTT, EAGLE-3 arXiv 2503.01840 §3): step ``k`` feeds the
  drafter's own step ``k-1`` output hidden state and the ground-truth token
  ``x[a+1+k]`` at position ``a+k``, attending to the cached keys of steps ``< k``
  under the same grid rule; step ``k`` is weighted ``decay**k``.
"""
from __future__ import annotations

import torch
from torch import nn
from peagle_train.peagle.masks import GridMeta
from peagle_train.model.drafter import Drafter
from peagle_train.peagle.grid import Grid, cod_keep_counts, pad_grid
from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.kernels.attention import _default_pad_multiple, make_attn_spec
from peagle_train.core.dtypes import acc_dtype


class PEagleObjective(nn.Module):
    """P-EAGLE grid loss.

    Args:
        drafter: a :class:`Drafter` with ``parallel_drafting``.
        target_head: ``[Vd, T]`` the target head's draft-vocab rows (frozen buffer).
        loss: ``"kl"`` / ``"ce"``. chunk_size: elements per loss chunk.
        attention: ``"flex"`` (split form) / ``"flex_joint"`` / ``"sdpa"`` (see :func:`make_attn_spec`).
        chain_kernel: the split form's chain part, ``"auto"`` (Triton on CUDA) / ``"triton"`` / ``"torch"``.
        fused_loss: gradients of the lm_head + loss computed in the loss forward (``train.fused_loss``,
            :func:`~peagle_train.loss.chunked_loss`).
        compile: ``train.compile`` — compile the drafter's decoder layers (:meth:`Drafter.set_compile`)
            and the loss chunk body (:func:`~peagle_train.loss.compiled_chunk_loss`); same math.
    """

    def __init__(self, drafter: Drafter, target_head: torch.Tensor, loss: str = "kl", chunk_size: int = 2048,
                 attention: str = "flex", pad_multiple: int | None = None, compile: bool = False,
                 chain_kernel: str = "auto", fused_loss: bool = True):
        super().__init__()
        self.fused_loss = fused_loss
        self.drafter = drafter
        self.chain_kernel = chain_kernel
        self.compile = compile
        drafter.set_compile(compile)
        self.register_buffer("target_head", target_head.detach().clone(), persistent=False)
        self.loss_kind, self.chunk_size, self.attention = loss, chunk_size, attention
        # compiled FlexAttention specialises on the sequence length: bucket it
        self.pad_multiple = pad_multiple if pad_multiple is not None else _default_pad_multiple(attention)

    def forward(self, grid: Grid, aux: torch.Tensor, last: torch.Tensor, argmax: torch.Tensor,
                normaliser: float):
        """Loss of one grid (or segment).

        Args:
            grid: elements (``[E]`` each). aux: ``[N, A*T]``. last: ``[N, T]``. argmax: ``[N]`` int64.
            normaliser: supervised count the loss sum is divided by (whole sequence/global batch).

        Returns:
            ``(loss scalar float32, draft_pred [E] int64 draft-vocab ids)``.
        """
        E = len(grid)
        grid = pad_grid(grid, self.pad_multiple)
        # K - 1 chain slots whatever this sample's deepest depth: one compiled layer shape per bucket.
        # Depths never exceed K - 1 and the real rows are at most the N tokens' depth-0 elements plus
        # the padding (row 0): with both bounds known on the host, building the step's inputs never
        # waits for the device (the checks run there, torch._assert_async).
        deepest = getattr(self.drafter.config, "num_parallel_depths", 1) - 1
        spec = make_attn_spec(GridMeta.of(grid), kind=self.attention, min_chain=deepest, max_depth=deepest,
                              chain_kernel=self.chain_kernel)
        hidden = self.drafter.grid_hidden(aux, grid.hidden_index, max_real=aux.shape[0] + len(grid) - E)
        h, _ = self.drafter(grid.token_ids, hidden, grid.position_ids, spec)
        target = TargetDist(last, self.target_head, argmax)
        loss, pred = chunked_loss(self.drafter.norm, self.drafter.lm_head, h, grid.label_index,
                                  _weights(grid.loss_weight, h) / normaliser, target, self.loss_kind, self.chunk_size,
                                  compile=self.compile, fused=self.fused_loss)
        return loss, pred[:E]


def _weights(loss_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Loss weights in the loss accumulation dtype (float64 stays exact; half types use float32)."""
    return loss_weight.to(acc_dtype(h.dtype))


def eagle3_step_lengths(E0: int, K: int, pad_multiple: int, cod: tuple[float, float, int | None] | None,
                        block: int = 128, static_tokens: int | None = None) -> list[int] | None:
    """Padded length of every EAGLE-3 TTT step, a function of one bucket ``Q`` only.

    ``Q = max(E0, static_tokens)`` rounded up to ``pad_multiple``. ``static_tokens`` is the most
    tokens a micro-batch can hold: every micro-batch then gets the same ``K`` shapes, so the
    compiled attention kernels are built once per run; None: ``Q`` follows ``E0``'s own bucket.
    Step ``k`` is padded to ``Q_k``: ``Q`` for ``k = 0``; with ``cod = (r, r_min, max_anchors)``
    the COD bound ``min(floor(Q·max(r**k, r_min)), max_anchors)`` rounded up to ``block`` (a step
    never holds more: COD keeps at most that many of the at most ``E0 <= Q`` depth-0 anchors,
    spec §3), else ``Q``. Step ``k`` then always attends ``[Q_k, Q_0 + … + Q_k]``: one compiled
    kernel per (bucket, step), not one per combination of COD sizes.

    Returns:
        ``[K]`` lengths, or None when ``pad_multiple <= 1`` (no padding: dense SDPA gets exact
        lengths, and fully masked padding rows would give NaN there).
    """
    if pad_multiple <= 1:
        return None
    Q = -(-max(E0, static_tokens or 0) // pad_multiple) * pad_multiple
    if cod is None:
        return [Q] * K
    bounds = cod_keep_counts(Q, K, *cod)  # what COD keeps of Q valid anchors: an upper bound per step
    return [Q] + [min(Q, max(block, -(-b // block) * block)) for b in bounds[1:]]


def eagle3_tokens(grid: Grid, input_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 TTT inputs: ground-truth token ``x[a+1+d]`` for every element ``(a, d)``."""
    return input_ids[grid.anchor + 1 + grid.depth]


class Eagle3Objective(nn.Module):
    """EAGLE-3 TTT loss over the grid's depths (depth = TTT step), weights ``decay**step``.

    Args:
        drafter: a :class:`Drafter` without parallel drafting (usually 1 layer).
        target_head, loss, chunk_size, attention, chain_kernel, fused_loss: as :class:`PEagleObjective`.
        decay: step weight base (0.8 in EAGLE-3). compile: as :class:`PEagleObjective`.
        cod: ``(r, r_min, max_anchors)`` of the grid's COD sample: bounds each step's padded length
            (:func:`eagle3_step_lengths`); None pads every step to the depth-0 bucket.
        static_tokens: most tokens one micro-batch can hold (``micro_batch_size ×`` longest sequence):
            every step is padded as for a grid that long, so the TTT unroll has one set of ``K``
            shapes per run. Without it, a short 3.5-minute H200 run spent most of its time
            compiling one kernel set per (bucket, step) (docs/results.md).
    """

    def __init__(self, drafter: Drafter, target_head: torch.Tensor, loss: str = "kl", chunk_size: int = 2048,
                 attention: str = "flex", decay: float = 0.8, pad_multiple: int | None = None,
                 compile: bool = False, cod: tuple[float, float, int | None] | None = None,
                 static_tokens: int | None = None, chain_kernel: str = "auto", fused_loss: bool = True):
        super().__init__()
        self.fused_loss = fused_loss
        self.cod, self.static_tokens = cod, static_tokens
        self.chain_kernel = chain_kernel
        self.drafter = drafter
        self.compile = compile
        drafter.set_compile(compile)
        self.register_buffer("target_head", target_head.detach().clone(), persistent=False)
        self.loss_kind, self.chunk_size, self.attention, self.decay = loss, chunk_size, attention, decay
        self.pad_multiple = pad_multiple if pad_multiple is not None else _default_pad_multiple(attention)

    def step_lengths(self, E0: int, K: int) -> list[int] | None:
        """Per-step padded lengths (:func:`eagle3_step_lengths` with this objective's settings)."""
        return eagle3_step_lengths(E0, K, self.pad_multiple, self.cod, static_tokens=self.static_tokens)

    def forward(self, grid: Grid, aux: torch.Tensor, last: torch.Tensor, argmax: torch.Tensor,
                normaliser: float, input_ids: torch.Tensor):
        """TTT unroll over ``grid.depth`` steps; returns ``(loss, draft_pred [E])`` in grid order.

        ``grid`` must be depth-major and each depth's anchors a subset of the previous
        depth's (as :func:`~peagle_train.grid.cod_sample` guarantees).
        """
        target = TargetDist(last, self.target_head, argmax)
        K = int(grid.depth.max()) + 1
        total = None
        preds = torch.empty_like(grid.anchor)
        past, kv_meta, prev_h, prev_anchor = None, None, None, None
        E0 = int((grid.depth == 0).sum())
        lengths = self.step_lengths(E0, K)
        for k in range(K):
            idx = (grid.depth == k).nonzero().flatten()
            if idx.numel() == 0:
                break
            Ek = idx.numel()
            target_len = lengths[k] if lengths is not None and Ek <= lengths[k] else None  # None: own bucket
            step = pad_grid(grid.select(idx), self.pad_multiple, length=target_len)
            if k == 0:
                hidden = self.drafter.project_aux(aux[step.anchor].to(self.drafter.fc.weight.dtype))
            else:
                at = torch.searchsorted(prev_anchor, step.anchor).clamp(max=prev_anchor.numel() - 1)
                hidden = prev_h[at]
            qm = GridMeta.of(step)
            kv_meta = qm if kv_meta is None else GridMeta(*(torch.cat([a, b]) for a, b in zip(
                (kv_meta.anchor, kv_meta.depth, kv_meta.doc), (qm.anchor, qm.depth, qm.doc))))
            spec = make_attn_spec(qm, kv_meta, kind=self.attention, chain_kernel=self.chain_kernel)
            h, past = self.drafter(eagle3_tokens(step, input_ids), hidden, step.position_ids, spec, past_kv=past)
            w = _weights(step.loss_weight, h) * (self.decay ** k) / normaliser
            part, pred = chunked_loss(self.drafter.norm, self.drafter.lm_head, h, step.label_index, w, target,
                                      self.loss_kind, self.chunk_size, compile=self.compile, fused=self.fused_loss)
            total = part if total is None else total + part
            preds[idx] = pred[:Ek]
            prev_h, prev_anchor = h[:Ek], step.anchor[:Ek]
        return total, preds
