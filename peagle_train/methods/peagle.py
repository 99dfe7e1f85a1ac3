"""P-EAGLE (parallel drafting, arXiv 2602.01469; spec §3-§5): K drafts from ONE drafter forward.

Training input: a COD sample of the N×K grid (depth ``d`` keeps ``max(r**d, r_min)`` of the
anchors kept at ``d - 1``); depths >= 1 read the reserved mask token and the learned
``mask_hidden``; the whole grid (or each sequence-partition segment of it) trains in one
forward (:class:`PEagleObjective`). Export: vLLM's ``parallel_drafting: true`` with
``ptd_token_id`` / ``pard_token`` = the mask token and ``num_parallel_depths`` = trained K.
Inference: one forward over ``[context..., bonus, MASK × (K-1)]`` proposes all K drafts.
"""
from __future__ import annotations

import torch
from torch import nn

from peagle_train.kernels.attention import default_pad_multiple, make_attn_spec, prefix_breaks_layer_graph
from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.methods.base import DraftMethod, config_field, loss_weights, register_method
from peagle_train.model.drafter import Drafter
from peagle_train.peagle.grid import Grid, pad_grid
from peagle_train.peagle.masks import GridMeta
from peagle_train.peagle.partition import plan_partitions


class PEagleObjective(nn.Module):
    """P-EAGLE grid loss.

    Args:
        drafter: a :class:`Drafter` with ``parallel_drafting``.
        target_head: ``[Vd, T]`` the target head's draft-vocab rows (frozen buffer).
        loss: ``"kl"`` / ``"ce"``. chunk_size: elements per loss chunk.
        attention: ``"flex"`` (split form) / ``"flex_joint"`` / ``"flex_flash"`` / ``"sdpa"`` (see
            :func:`make_attn_spec`).
        chain_kernel: the split form's chain part, ``"auto"`` (Triton on CUDA) / ``"triton"`` / ``"torch"``.
        fused_loss: gradients of the lm_head + loss computed in the loss forward (``train.fused_loss``,
            :func:`~peagle_train.kernels.loss.chunked_loss`).
        compile: ``train.compile`` — compile the drafter's decoder layers (:meth:`Drafter.set_compile`)
            and the loss chunk body (:func:`~peagle_train.kernels.loss.compiled_chunk_loss`); same math.
        depth_weights: ``train.depth_weights``, ``K`` floats: in training mode an element at depth ``d``
            weighs ``depth_weights[d]`` times its unit weight (the normaliser is unchanged, so sequence
            partitions still add up, spec §3); ``None`` or ``eval()`` mode: the spec's unweighted loss.
        prefix_kernel_options: ``train.prefix_kernel_options``, FlexAttention ``kernel_options`` of the split
            form's prefix part (CUDA): ``"auto"`` (resolved per grid device,
            :func:`~peagle_train.kernels.attention.prefix_kernel_options_for`), a mapping, or None = its own
            choice. Same math.
        prefix_compiled_apart: ``train.prefix_compiled_apart``: with ``compile`` and the split form (``attention``
            ``"flex"``), the prefix FlexAttention runs as its own compiled kernel behind a graph break (those layers
            compile with graph breaks allowed; other attention kinds keep ``fullgraph=True``).

    Raises:
        ValueError: ``depth_weights`` not one per parallel depth of ``drafter``.
    """

    def __init__(self, drafter: Drafter, target_head: torch.Tensor, loss: str = "kl", chunk_size: int = 2048,
                 attention: str = "flex", pad_multiple: int | None = None, compile: bool = False,
                 chain_kernel: str = "auto", fused_loss: bool = True, depth_weights=None,
                 prefix_kernel_options: str | dict | None = None, prefix_compiled_apart: bool = False):
        super().__init__()
        self.prefix_kernel_options = prefix_kernel_options
        self.prefix_compiled_apart = prefix_compiled_apart
        self.fused_loss = fused_loss
        self.drafter = drafter
        self.chain_kernel = chain_kernel
        self.compile = compile
        drafter.set_compile(compile, fullgraph=not prefix_breaks_layer_graph(attention, prefix_compiled_apart))
        self.register_buffer("target_head", target_head.detach().clone(), persistent=False)
        if depth_weights is not None:
            K = getattr(drafter.config, "num_parallel_depths", 1)
            if len(depth_weights) != K:
                raise ValueError(f"depth_weights has {len(depth_weights)} numbers, the drafter drafts K = {K} depths")
            depth_weights = torch.tensor(depth_weights, dtype=torch.float64)
        self.register_buffer("depth_weights", depth_weights, persistent=False)  # [K] float64 or None
        self.loss_kind, self.chunk_size, self.attention = loss, chunk_size, attention
        # compiled FlexAttention specialises on the sequence length: bucket it
        self.pad_multiple = pad_multiple if pad_multiple is not None else default_pad_multiple(attention)

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
                              chain_kernel=self.chain_kernel, prefix_kernel_options=self.prefix_kernel_options,
                              prefix_compiled_apart=self.prefix_compiled_apart)
        hidden = self.drafter.grid_hidden(aux, grid.hidden_index, max_real=aux.shape[0] + len(grid) - E)
        h, _ = self.drafter(grid.token_ids, hidden, grid.position_ids, spec)
        target = TargetDist(last, self.target_head, argmax)
        weight = loss_weights(grid.loss_weight, h)
        if self.depth_weights is not None and self.training:
            weight = weight * self.depth_weights.to(weight.dtype)[grid.depth]
        loss, pred = chunked_loss(self.drafter.norm, self.drafter.lm_head, h, grid.label_index,
                                  weight / normaliser, target, self.loss_kind, self.chunk_size,
                                  compile=self.compile, fused=self.fused_loss)
        return loss, pred[:E]


@register_method
class PEagle(DraftMethod):
    """P-EAGLE: parallel drafting with a learned mask hidden state and mask token (``train.method: peagle``)."""

    name = "peagle"
    title = "P-EAGLE (parallel drafting)"
    memory_planned = True
    serves_above_trained_K = False

    def validate_recipe(self, cfg) -> None:
        """Served K never exceeds trained K: mask depths beyond it were never trained (spec §4)."""
        if cfg.eval.k_max > cfg.train.K:
            raise ValueError(f"eval.k_max ({cfg.eval.k_max}) exceeds train.K ({cfg.train.K}): served K must be "
                             "<= trained K (P-EAGLE's mask depths beyond it were never trained, spec §4)")

    def drafter_fields(self, cfg) -> dict:
        return {"mask_token_id": cfg.drafter.mask_token_id, "parallel_drafting": True}

    def describes(self, config) -> bool:
        return config_field(config, "parallel_drafting") is True

    def cod_rates(self, train_cfg) -> tuple[float, float]:
        return train_cfg.cod_r, train_cfg.cod_r_min

    def grid_mask_id(self, cfg) -> int:
        return cfg.drafter.mask_token_id

    def segments(self, host_grid: Grid, n_tokens: int, S: int) -> list:
        return plan_partitions(host_grid, n_tokens, S)

    def build_objective(self, drafter, target_head, cfg, *, attention, chain_kernel, max_micro_tokens):
        tc = cfg.train
        return PEagleObjective(drafter, target_head, loss=tc.loss, chunk_size=tc.loss_chunk_size, attention=attention,
                               compile=tc.compile, chain_kernel=chain_kernel, fused_loss=tc.fused_loss,
                               depth_weights=tc.depth_weights, prefix_kernel_options=tc.prefix_kernel_options,
                               prefix_compiled_apart=tc.prefix_compiled_apart)

    def check_target(self, config, vocab_size: int) -> None:
        m = config_field(config, "mask_token_id")
        if m is None or not 0 <= m < vocab_size:
            raise ValueError(f"mask_token_id {m} outside the target vocab [0, {vocab_size})")

    def vllm_fields(self, config) -> dict:
        m = config_field(config, "mask_token_id")
        if m is None:
            raise ValueError("a P-EAGLE drafter (parallel_drafting) needs config.mask_token_id to export "
                             "ptd_token_id/pard_token; set drafter.mask_token_id")
        return {"parallel_drafting": True, "ptd_token_id": int(m), "pard_token": int(m),
                "num_parallel_depths": int(config_field(config, "num_parallel_depths", 1))}

    def speculators_fields(self, flat: dict, config) -> dict:
        return {"kind": "peagle", "architecture": "PEagleSpeculator", "K": flat.get("num_parallel_depths", 1),
                "extra": {"mask_token_id": flat["ptd_token_id"], "embed_requires_grad": True}}

    def drafter_fields_from_export(self, flat: dict) -> dict:
        return {"mask_token_id": flat["ptd_token_id"], "parallel_drafting": True}

    def check_served_K(self, drafter, K: int) -> None:
        cfg = drafter.config
        trained = getattr(cfg, "num_parallel_depths", None)
        if trained is None or K > trained:
            raise ValueError(
                f"served K={K} exceeds the drafter's trained K (num_parallel_depths={trained}): parallel "
                "drafting can only serve K <= trained K (spec §4)"
            )
        if getattr(cfg, "mask_token_id", None) is None or not hasattr(drafter, "mask_hidden"):
            raise ValueError("parallel drafting needs a drafter with mask_token_id and mask_hidden (P-EAGLE)")

    def draft_round(self, session, ctx_tokens, hidden, positions, pick):
        """One forward over ``[new context..., MASK × (K-1)]``: the bonus slot and the mask slots give
        the K drafts; the mask slots' KV is dropped (vLLM's layout, spec §4)."""
        d, P, n, m = session.drafter, session.num_cached, ctx_tokens.numel(), session.K - 1
        tokens = torch.cat([ctx_tokens, ctx_tokens.new_full((m,), d.config.mask_token_id)])  # [n+m]
        hidden = torch.cat([hidden, d.mask_hidden_projected().expand(m, -1)])  # [n+m, H]
        positions = torch.arange(P, P + n + m, device=ctx_tokens.device)  # mask slots at t+1 .. t+K-1
        h, kv = session.forward(tokens, hidden, positions, session.kv)
        session.kv = [(k[:, :, : P + n], v[:, :, : P + n]) for k, v in kv]  # drop mask-slot KV
        logits = d.logits(h[n - 1:])  # [K, Vd]: bonus slot, then mask slots
        ids, q = pick(logits)  # all K rows at once (greedy: one argmax; a host-bound loop pays per launch)
        return logits, [(ids[i], None if q is None else q[i]) for i in range(session.K)]
