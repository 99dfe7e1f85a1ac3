"""The EAGLE-3 baseline (arXiv 2503.01840) with training-time test (TTT): K drafts from K chained
drafter forwards.

Training input: the grid with every depth kept (depth = TTT step); step ``k`` feeds the
drafter's own step ``k-1`` output hidden state and the ground-truth token ``x[a+1+k]`` at
position ``a+k``, attending to the cached keys of steps ``< k`` under the same grid rule; step
``k`` is weighted ``decay**k`` (:class:`Eagle3Objective`). No sequence partitioning. Export:
vLLM's ``eagle3`` layout without parallel-drafting fields. Inference: a chain of K drafter forwards.
"""
from __future__ import annotations

import torch
from torch import nn

from peagle_train.kernels.attention import default_pad_multiple, make_attn_spec, prefix_breaks_layer_graph
from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.methods.base import DraftMethod, config_field, loss_weights, register_method
from peagle_train.model.drafter import Drafter
from peagle_train.peagle.grid import Grid, cod_keep_counts, pad_grid
from peagle_train.peagle.masks import GridMeta


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
        target_head, loss, chunk_size, attention, chain_kernel, fused_loss, prefix_kernel_options,
            prefix_compiled_apart: as :class:`PEagleObjective`.
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
                 static_tokens: int | None = None, chain_kernel: str = "auto", fused_loss: bool = True,
                 prefix_kernel_options: str | dict | None = None, prefix_compiled_apart: bool = False):
        super().__init__()
        self.prefix_kernel_options = prefix_kernel_options
        self.prefix_compiled_apart = prefix_compiled_apart
        self.fused_loss = fused_loss
        self.cod, self.static_tokens = cod, static_tokens
        self.chain_kernel = chain_kernel
        self.drafter = drafter
        self.compile = compile
        drafter.set_compile(compile, fullgraph=not prefix_breaks_layer_graph(attention, prefix_compiled_apart))
        self.register_buffer("target_head", target_head.detach().clone(), persistent=False)
        self.loss_kind, self.chunk_size, self.attention, self.decay = loss, chunk_size, attention, decay
        self.pad_multiple = pad_multiple if pad_multiple is not None else default_pad_multiple(attention)

    def step_lengths(self, E0: int, K: int) -> list[int] | None:
        """Per-step padded lengths (:func:`eagle3_step_lengths` with this objective's settings)."""
        return eagle3_step_lengths(E0, K, self.pad_multiple, self.cod, static_tokens=self.static_tokens)

    def forward(self, grid: Grid, aux: torch.Tensor, last: torch.Tensor, argmax: torch.Tensor,
                normaliser: float, input_ids: torch.Tensor):
        """TTT unroll over ``grid.depth`` steps; returns ``(loss, draft_pred [E])`` in grid order.

        ``grid`` must be depth-major and each depth's anchors a subset of the previous
        depth's (as :func:`~peagle_train.peagle.grid.cod_sample` guarantees).
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
            spec = make_attn_spec(qm, kv_meta, kind=self.attention, chain_kernel=self.chain_kernel,
                                  prefix_kernel_options=self.prefix_kernel_options,
                                  prefix_compiled_apart=self.prefix_compiled_apart)
            h, past = self.drafter(eagle3_tokens(step, input_ids), hidden, step.position_ids, spec, past_kv=past)
            w = loss_weights(step.loss_weight, h) * (self.decay ** k) / normaliser
            part, pred = chunked_loss(self.drafter.norm, self.drafter.lm_head, h, step.label_index, w, target,
                                      self.loss_kind, self.chunk_size, compile=self.compile, fused=self.fused_loss)
            total = part if total is None else total + part
            preds[idx] = pred[:Ek]
            prev_h, prev_anchor = h[:Ek], step.anchor[:Ek]
        return total, preds


@register_method
class Eagle3(DraftMethod):
    """EAGLE-3 with TTT (``train.method: eagle3``): the chain-drafting baseline."""

    name = "eagle3"
    title = "EAGLE-3"

    def validate_recipe(self, cfg) -> None:
        if cfg.train.partitions != 1:
            raise ValueError("train.partitions other than 1 is only defined for method 'peagle'")
        if cfg.train.depth_weights is not None:
            raise ValueError("train.depth_weights is P-EAGLE's; EAGLE-3 weighs its TTT steps by train.ttt_decay**step")

    def describes(self, config) -> bool:
        return config_field(config, "parallel_drafting") is not True

    def build_objective(self, drafter, target_head, cfg, *, attention, chain_kernel, max_micro_tokens):
        tc = cfg.train
        return Eagle3Objective(drafter, target_head, loss=tc.loss, chunk_size=tc.loss_chunk_size, attention=attention,
                               compile=tc.compile, chain_kernel=chain_kernel, fused_loss=tc.fused_loss,
                               decay=tc.ttt_decay, cod=(tc.cod_r, tc.cod_r_min, tc.max_anchors),
                               static_tokens=max_micro_tokens, prefix_kernel_options=tc.prefix_kernel_options,
                               prefix_compiled_apart=tc.prefix_compiled_apart)

    def objective_inputs(self, packed: dict) -> tuple:
        return (packed["input_ids"],)

    def speculators_fields(self, flat: dict, config) -> dict:
        return {"kind": "eagle3", "architecture": "Eagle3Speculator",
                "K": int(getattr(config, "num_parallel_depths", 3)), "extra": {}}

    def draft_round(self, session, ctx_tokens, hidden, positions, pick):
        """The context slots in one forward, then K - 1 chain slots: token = the previous draft,
        hidden = the previous output; the chain slots' KV is discarded after the round."""
        d, dev = session.drafter, ctx_tokens.device
        h, kv = session.forward(ctx_tokens, hidden, positions, session.kv)
        session.kv = kv  # every slot of this forward is a committed context slot
        rows = [d.logits(h[-1])]  # [Vd]
        picks = [pick(rows[0])]
        h_prev, past, pos = h[-1:], kv, session.num_cached + ctx_tokens.numel() - 1
        for _ in range(session.K - 1):
            pos += 1
            tok = picks[-1][0].view(1)
            h_prev, past = session.forward(tok, h_prev, torch.tensor([pos], device=dev), past)
            rows.append(d.logits(h_prev[0]))
            picks.append(pick(rows[-1]))
        return torch.stack(rows), picks  # [K, Vd]
