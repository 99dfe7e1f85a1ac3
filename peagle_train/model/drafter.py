"""The P-EAGLE drafter (and the EAGLE-3 baseline on the same code), spec §2.

Module attribute names are exactly vLLM's checkpoint keys
(``vllm/model_executor/models/llama_eagle3.py``): ``fc``, ``layers.i.*``,
``layers.0.hidden_norm``, ``norm``, ``lm_head``, ``embed_tokens``,
``mask_hidden``, buffers ``d2t``/``t2d``. So ``state_dict()`` needs only a dtype
cast to become an export.

Shape legend: ``E`` grid elements (or new KV-cache slots), ``N`` tokens,
``T`` target hidden, ``A`` aux layers (3), ``H`` drafter hidden, ``V`` target
vocab, ``Vd`` draft vocab, ``nh``/``nkv`` query/KV heads, ``hd`` head dim.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding, apply_rotary_pos_emb

from peagle_train.core.dtypes import acc_dtype
from peagle_train.kernels.attention import AttnSpec, attend
from peagle_train.kernels.selective_checkpoint import checkpointing_mode, selective_checkpoint, warn_flex_not_kept


class RMSNorm(nn.Module):
    """Llama RMSNorm (same math as ``LlamaRMSNorm``) computed in ``promote(dtype, float32)``,
    so float64 exactness tests stay float64 while bf16 inputs are normalised in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` → normalised ``[..., H]`` in ``x``'s dtype."""
        dt = acc_dtype(x.dtype)
        xf = x.to(dt)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class DrafterAttention(nn.Module):
    """Llama attention whose q/k/v input width is ``in_features`` (``2H`` in layer 0)."""

    def __init__(self, config: LlamaConfig, in_features: int):
        super().__init__()
        self.nh, self.nkv, self.hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(in_features, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(in_features, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(in_features, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, config.hidden_size, bias=bias)

    def forward(self, x, cos, sin, spec: AttnSpec, past_kv=None):
        """x ``[E, in]``; cos/sin ``[1, E, hd]``; past_kv ``(k, v)`` each ``[1, nkv, P, hd]`` or None.

        Returns ``(out [E, H], (k, v))`` with ``k/v [1, nkv, P + E, hd]`` (post-RoPE).
        """
        E = x.shape[0]
        q = self.q_proj(x).view(1, E, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(1, E, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(1, E, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        o = attend(q, k, v, spec)  # [1, nh, E, hd]
        return self.o_proj(o.transpose(1, 2).reshape(E, self.nh * self.hd)), (k, v)


class DrafterLayer(nn.Module):
    """A Llama decoder layer; layer 0 is the fusion layer of spec §2.

    Fusion (layer 0): ``x = cat(input_layernorm(emb), hidden_norm(hidden))`` (width 2H)
    into attention, residual = ``hidden`` (``norm_before_residual=False``).
    """

    def __init__(self, config: LlamaConfig, index: int):
        super().__init__()
        H = config.hidden_size
        self.fusion = index == 0
        self.input_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        if self.fusion:
            self.hidden_norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, 2 * H if self.fusion else H)
        self.post_attention_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, emb, cos, sin, spec, past_kv=None):
        """h ``[E, H]`` hidden (layer 0: fc-projected aux/mask hidden), emb ``[E, H]`` token embeddings;
        returns ``(h [E, H], (k, v))`` (see :meth:`DrafterAttention.forward`)."""
        if self.fusion:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        else:
            x = self.input_layernorm(h)
        a, kv = self.self_attn(x, cos, sin, spec, past_kv)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


def make_drafter_config(
    target_config,
    *,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    mask_token_id: int | None,
    num_layers: int = 4,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    parallel_drafting: bool = True,
    K: int = 8,
    allow_hidden_size_mismatch: bool = False,
    embeddings: str = "trainable",
    lm_head: str = "trainable",
) -> LlamaConfig:
    """Drafter ``LlamaConfig`` from the target's, carrying the P-EAGLE extras.

    Only drafter-relevant fields are copied (spec §5: never ``layer_types``,
    ``sliding_window``, ``quantization_config``, biases). Extras:
    ``target_hidden_size``, ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``,
    ``mask_token_id`` (None for EAGLE-3), ``parallel_drafting``, ``num_parallel_depths`` (K),
    ``frozen_embeddings`` (``embeddings == "frozen"``: :class:`Drafter` keeps its table fixed and trains the
    mask row alone; never exported: the export ships the merged table), ``frozen_lm_head``
    (``lm_head == "frozen"``; never exported).

    Raises:
        ValueError: ``H != T`` without ``allow_hidden_size_mismatch`` (spec §5 decision),
            ``embeddings`` or ``lm_head`` not ``trainable``/``frozen``, or ``frozen`` with ``H != T``, or fewer
            than 1 layer.
    """
    T = target_config.hidden_size
    H = hidden_size or T
    if H != T and not allow_hidden_size_mismatch:
        raise ValueError(
            f"drafter.hidden_size={H} differs from the target hidden size {T}; set "
            "drafter.allow_hidden_size_mismatch: true to opt in (needs vLLM >= 0.33)"
        )
    for key, value in (("embeddings", embeddings), ("lm_head", lm_head)):
        if value not in ("trainable", "frozen"):
            raise ValueError(f"drafter.{key} must be 'trainable' or 'frozen', got {value!r}")
        if value == "frozen" and H != T:
            raise ValueError(f"drafter.{key}: frozen keeps the target's rows, which need hidden_size {H} == the "
                             f"target's {T}; use drafter.{key}: trainable")
    nh = num_attention_heads or target_config.num_attention_heads
    hd = head_dim or getattr(target_config, "head_dim", None) or T // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None)
    kwargs = dict(
        hidden_size=H,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=nh,
        num_key_value_heads=num_key_value_heads or target_config.num_key_value_heads,
        head_dim=hd,
        rms_norm_eps=target_config.rms_norm_eps,
        hidden_act="silu",
        max_position_embeddings=target_config.max_position_embeddings,
        vocab_size=target_config.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    if rope is not None:
        kwargs["rope_parameters"] = dict(rope)
    else:  # older transformers
        kwargs["rope_theta"] = getattr(target_config, "rope_theta", 10000.0)
        kwargs["rope_scaling"] = getattr(target_config, "rope_scaling", None)
    cfg = LlamaConfig(**kwargs)
    cfg.target_hidden_size = T
    cfg.draft_vocab_size = draft_vocab_size
    cfg.eagle_aux_hidden_state_layer_ids = list(aux_layer_ids)
    cfg.mask_token_id = mask_token_id if parallel_drafting else None
    cfg.parallel_drafting = parallel_drafting
    cfg.num_parallel_depths = K
    cfg.allow_hidden_size_mismatch = allow_hidden_size_mismatch
    cfg.frozen_embeddings = embeddings == "frozen"
    cfg.frozen_lm_head = lm_head == "frozen"
    return cfg


class Drafter(nn.Module):
    """P-EAGLE drafter (``parallel_drafting=True``) or EAGLE-3 drafter, spec §2.

    Parameters: ``embed_tokens [V, H]`` (trainable, from the target), ``fc [H, A*T]``,
    ``layers``, ``norm [H]``, ``lm_head [Vd, H]``, ``mask_hidden [1, 1, A*T]`` (P-EAGLE
    only: h_shared in pre-fc space). Buffers ``d2t [Vd]`` int64 (draft id + d2t =
    target id) and ``t2d [V]`` bool.

    With ``config.frozen_embeddings`` (``drafter.embeddings: frozen``) ``embed_tokens`` does not train
    and a P-EAGLE drafter has ``mask_embedding [H]`` instead: the mask token's embedding, initialised to
    the table's row and used wherever the input is the mask token; :meth:`merged_embeddings` is the
    table with that row in place, what the export ships as ``embed_tokens`` (spec §5).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        H, T = config.hidden_size, config.target_hidden_size
        A = len(config.eagle_aux_hidden_state_layer_ids)
        V, Vd = config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(A * T, H, bias=False)
        self.layers = nn.ModuleList([DrafterLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        if config.parallel_drafting:
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, A * T))
        if getattr(config, "frozen_lm_head", False):
            self.lm_head.weight.requires_grad_(False)
        if getattr(config, "frozen_embeddings", False):
            self.embed_tokens.weight.requires_grad_(False)
            if config.mask_token_id is not None:
                self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if Vd == V else torch.zeros(V, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.gradient_checkpointing: bool | str = False  # train.activation_checkpointing: False, True, "selective"
        self._compiled_layers: list | None = None  # set by set_compile (not submodules: state_dict unchanged)
        self._compile_cache: list | None = None
        self._selective_cache: list | None = None  # the compiled layers under selective checkpointing
        self.reset_parameters()

    def set_compile(self, enabled: bool | str = True, fullgraph: bool = True) -> None:
        """Run each decoder layer through ``torch.compile(layer, fullgraph=fullgraph, dynamic=False)``
        (``train.compile``, issue #7), or back to eager with ``enabled=False``. ``enabled="max-autotune"``
        also benchmarks FlexAttention's kernel configs at each first compile
        (:data:`~peagle_train.kernels.compiling.AUTOTUNE_OPTIONS`).

        Compilation happens lazily on the first forward, once per distinct (bucketed) grid
        length. Each layer is wrapped in :class:`~peagle_train.kernels.compiling.SafeCompiled`: a
        compile failure retries with graph breaks, then falls back to eager with a warning.
        FlexAttention called inside a compiled layer is traced into the layer's graph.
        Parameters and ``state_dict`` keys are untouched; activation checkpointing
        (``gradient_checkpointing`` True) wraps the compiled layer; selective checkpointing (``"selective"``) is
        compiled inside each layer's own compiled call (:meth:`_selective_calls`). ``fullgraph=False`` compiles with graph breaks
        allowed from the first call (``train.prefix_compiled_apart``: the prefix attention is a graph break by
        design, so a ``fullgraph=True`` attempt would only fail and warn first).
        """
        if not enabled:
            self._compiled_layers = None
            return
        from peagle_train.kernels.compiling import SafeCompiled, inductor_mode

        mode = inductor_mode(enabled)
        if (self._compile_cache is None or len(self._compile_cache) != len(self.layers)
                or self._compile_cache[0].inductor_mode != mode or self._compile_cache[0].fullgraph != fullgraph):
            self._compile_cache = [SafeCompiled(layer, f"drafter.layers.{i}", inductor_mode=mode, fullgraph=fullgraph)
                                   for i, layer in enumerate(self.layers)]
            self._selective_cache = None
        self._compiled_layers = self._compile_cache

    @property
    def compiled(self) -> bool:
        """Whether :meth:`set_compile` is on."""
        return self._compiled_layers is not None

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) linears, unit norms, ``mask_hidden`` ~ Normal(0, std)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if hasattr(self, "mask_hidden"):
            nn.init.normal_(self.mask_hidden, std=std)
        self._mask_embedding_from_table()

    @torch.no_grad()
    def _mask_embedding_from_table(self) -> None:
        """``mask_embedding`` (frozen embeddings only) := the table's mask row."""
        if hasattr(self, "mask_embedding"):
            self.mask_embedding.copy_(self.embed_tokens.weight[self.config.mask_token_id])

    def merged_embeddings(self) -> torch.Tensor:
        """``[V, H]`` in the table's dtype: the embedding table the drafter uses, i.e. ``embed_tokens`` with, for
        frozen embeddings, the trained ``mask_embedding`` as the mask token's row (a detached copy; what the
        export ships). Without ``mask_embedding``: ``embed_tokens.weight`` itself."""
        w = self.embed_tokens.weight
        if not hasattr(self, "mask_embedding"):
            return w
        w = w.detach().clone()
        w[self.config.mask_token_id] = self.mask_embedding.detach().to(w.dtype)
        return w

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor, draft_ids: torch.Tensor):
        """Copy the target's embeddings ``[V, H]`` and its head rows ``head_weight[draft_ids]`` ``[Vd, H]``;
        set ``d2t = draft_ids - arange(Vd)`` and ``t2d``.

        Raises:
            ValueError: shape mismatch (``H != T`` cannot reuse target embeddings) or unsorted ids.
        """
        if embed_weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embeddings {tuple(embed_weight.shape)} != drafter {tuple(self.embed_tokens.weight.shape)}")
        self.set_draft_vocab(draft_ids)
        self.embed_tokens.weight.copy_(embed_weight)
        self._mask_embedding_from_table()
        self.lm_head.weight.copy_(head_weight[draft_ids.to(head_weight.device)])

    @torch.no_grad()
    def init_layers_from_target(self, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor) -> None:
        """Start the decoder layers, ``fc`` and ``norm`` from the target (``drafter.init_layers: target``).

        Args:
            layers: one dict per drafter layer (``num_hidden_layers`` of them), the tensors of the target
                decoder layer it starts from, keyed as in a Llama layer (``input_layernorm.weight``,
                ``self_attn.{q,k,v,o}_proj.weight``, ``post_attention_layernorm.weight``,
                ``mlp.{gate,up,down}_proj.weight``); the caller picks the layers (the target's last ``n``).
            final_norm: the target's final RMSNorm weight ``[T]``.

        Layers ``i >= 1`` are copied. The fusion layer 0 (spec §2) reads ``cat(input_layernorm(emb),
        hidden_norm(h))``: its q/k/v take the target's weights on the hidden half and zeros on the
        embedding half, and both of its input norms the target's ``input_layernorm``; the rest is copied.
        ``fc`` ``[H, A*T]`` becomes zeros with an identity block on the last aux state, so at the start
        layer 0 sees that state as the target's layer would. Zero weights still receive gradients
        (``dL/dW = g x^T``): the embedding half and the other aux states train from step 0.
        ``mask_hidden`` and the embeddings/head are left as they are.

        Raises:
            ValueError: ``H != T``, a wrong number of layers, a missing tensor or a shape unlike the
                drafter's (naming the layer and key).
        """
        H, T = self.config.hidden_size, self.config.target_hidden_size
        if H != T:
            raise ValueError(f"init_layers_from_target needs hidden_size {H} == the target's {T}")
        if len(layers) != len(self.layers):
            raise ValueError(f"init_layers_from_target: {len(layers)} target layers for {len(self.layers)} drafter layers")
        for i, (layer, src) in enumerate(zip(self.layers, layers)):
            for name, p in layer.named_parameters():
                key = "input_layernorm.weight" if name == "hidden_norm.weight" else name
                if key not in src:
                    raise ValueError(f"init_layers_from_target: target layer for drafter layer {i} has no '{key}' "
                                     f"(has {sorted(src)[:8]}...): not a dense Llama-style layer")
                w = src[key].to(device=p.device, dtype=p.dtype)
                if layer.fusion and name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                    if tuple(w.shape) != (p.shape[0], H):
                        raise ValueError(f"init_layers_from_target: '{key}' of drafter layer {i}: target "
                                         f"{tuple(w.shape)}, drafter hidden half {(p.shape[0], H)}")
                    p.zero_()
                    p[:, H:].copy_(w)  # x = cat(emb half, hidden half)
                    continue
                if w.shape != p.shape:
                    raise ValueError(f"init_layers_from_target: '{key}' of drafter layer {i}: target "
                                     f"{tuple(w.shape)}, drafter {tuple(p.shape)}")
                p.copy_(w)
        if final_norm.shape != self.norm.weight.shape:
            raise ValueError(f"init_layers_from_target: final norm {tuple(final_norm.shape)}, drafter "
                             f"{tuple(self.norm.weight.shape)}")
        self.norm.weight.copy_(final_norm)
        A = len(self.config.eagle_aux_hidden_state_layer_ids)
        self.fc.weight.zero_()
        self.fc.weight[:, (A - 1) * T:].copy_(torch.eye(H, dtype=self.fc.weight.dtype, device=self.fc.weight.device))

    @torch.no_grad()
    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """``draft_ids`` ``[Vd]`` int64, strictly increasing target ids (spec §2)."""
        draft_ids = draft_ids.to(self.d2t.device)
        if draft_ids.numel() != self.d2t.numel() or (draft_ids[1:] <= draft_ids[:-1]).any():
            raise ValueError("draft_ids must be Vd strictly increasing target ids")
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids with ``d2t`` (int64, any shape)."""
        return draft_ids + self.d2t[draft_ids]

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` on aux states ``[..., A*T]`` → ``[..., H]``."""
        return self.fc(aux)

    def mask_hidden_projected(self) -> torch.Tensor:
        """``fc(mask_hidden)`` → ``[H]``: what every mask slot receives (vLLM ``combine_hidden_states``)."""
        return self.fc(self.mask_hidden.view(-1))

    def grid_hidden(self, aux: torch.Tensor, hidden_index: torch.Tensor, max_real: int | None = None) -> torch.Tensor:
        """Per-element fc-projected hidden input.

        Args:
            aux: ``[N, A*T]`` aux states of the packed sequence.
            hidden_index: ``[E]`` int64, row of ``aux`` or ``-1`` for ``mask_hidden``.
            max_real: an upper bound, known on the host, on the number of elements with a real
                row (``hidden_index >= 0``). Then the rows are found with ``nonzero_static`` (no
                host sync) and ``fc`` runs on ``max_real`` rows, the unused ones discarded.
                None: one host sync (``nonzero``) and ``fc`` on exactly the real rows.

        Returns:
            ``[E, H]``; ``fc`` runs on the real rows only (up to ``max_real`` of them).

        Raises:
            ValueError: an EAGLE-3 drafter (no ``mask_hidden``) given a ``-1`` row.
            RuntimeError: more than ``max_real`` real rows (CPU: at once; CUDA: a device-side
                assert, ``torch._assert_async``).
        """
        is_real = hidden_index >= 0
        E = hidden_index.numel()
        if not hasattr(self, "mask_hidden"):  # EAGLE-3: every element has a real row
            msg = "an EAGLE-3 drafter has no mask_hidden; every element needs a real hidden state"
            if max_real is not None:
                torch._assert_async(is_real.all(), msg)
            elif not bool(is_real.all()):  # one host sync
                raise ValueError(msg)
            return self.fc(aux[hidden_index].to(self.fc.weight.dtype))
        if max_real is None:
            real_at = is_real.nonzero().flatten()  # one host sync, not two boolean-mask indexings
        else:  # no host sync: padded with E (a scratch row dropped below)
            torch._assert_async(is_real.sum() <= max_real, f"grid_hidden: more than max_real={max_real} real rows")
            try:
                real_at = torch.nonzero_static(is_real, size=min(max_real, E), fill_value=E).flatten()
            except NotImplementedError:  # a backend without nonzero_static: the exact rows, one sync
                real_at = is_real.nonzero().flatten()
        rows = hidden_index[real_at.clamp(max=E - 1)].clamp(min=0)  # scratch slots read any valid row
        real = self.fc(aux[rows].to(self.fc.weight.dtype))
        out = self.mask_hidden_projected().expand(E + 1, -1).clone()  # row E: scratch for padded slots
        return out.to(real.dtype).index_copy(0, real_at, real)[:E]

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        spec: AttnSpec,
        past_kv: list | None = None,
    ):
        """Run the decoder stack.

        Args:
            token_ids: ``[E]`` int64 input tokens.
            hidden: ``[E, H]`` fc-projected hidden inputs (see :meth:`grid_hidden`).
            position_ids: ``[E]`` int64 RoPE positions.
            spec: attention of the ``E`` queries over ``P + E`` keys (``P`` cached).
            past_kv: per layer ``(k, v)`` each ``[1, nkv, P, hd]``, or None.

        Returns:
            ``(h [E, H] pre-norm output, kv)``; ``kv`` per layer ``(k, v)`` ``[1, nkv, P+E, hd]``.
            Logits are ``lm_head(norm(h))`` (see :meth:`logits`), computed by the loss in chunks.
        """
        emb = self.embed_tokens(token_ids)
        if hasattr(self, "mask_embedding"):  # frozen table: the mask token's row is the trained parameter
            emb = torch.where((token_ids == self.config.mask_token_id).unsqueeze(-1), self.mask_embedding.to(emb.dtype),
                              emb)
        cos, sin = self.rotary_emb(hidden, position_ids[None])
        h = hidden
        new_kv = []
        calls = self._compiled_layers if self._compiled_layers is not None else self.layers
        mode = checkpointing_mode(self.gradient_checkpointing) if self.training else False
        if mode == "selective":
            if self._compiled_layers is None and (spec.split is not None or spec.block_mask is not None):
                warn_flex_not_kept()
            calls = self._selective_calls()
        for i, layer in enumerate(calls):
            pkv = past_kv[i] if past_kv is not None else None
            if mode is True:
                h, kv = torch.utils.checkpoint.checkpoint(layer, h, emb, cos, sin, spec, pkv, use_reentrant=False)
            else:  # no checkpointing, or selective (the checkpoint is inside the call)
                h, kv = layer(h, emb, cos, sin, spec, pkv)
            new_kv.append(kv)
        return h, new_kv

    def _selective_calls(self) -> list:
        """The layers under selective activation checkpointing (``gradient_checkpointing == "selective"``,
        :mod:`~peagle_train.kernels.selective_checkpoint`): eager, or each compiled with the checkpoint inside
        (``torch.compile`` of ``selective_checkpoint(layer, ...)``, as :meth:`set_compile` set the mode), built at
        the first such call and kept until :meth:`set_compile` changes."""
        if self._compiled_layers is None:
            return [functools.partial(selective_checkpoint, layer) for layer in self.layers]
        if self._selective_cache is None:
            from peagle_train.kernels.compiling import SafeCompiled

            first = self._compile_cache[0]
            if not first.fullgraph:  # a graph break inside the checkpoint region: Dynamo would skip it whole
                raise ValueError("selective activation checkpointing needs each layer compiled in one graph; "
                                 "train.prefix_compiled_apart breaks it at the prefix attention: turn one of them off")
            self._selective_cache = [  # no graph-breaks retry: it would compile nothing (SafeCompiled graph_breaks)
                SafeCompiled(functools.partial(selective_checkpoint, layer), f"drafter.layers.{i} (selective)",
                             inductor_mode=first.inductor_mode, fullgraph=True, graph_breaks=False)
                for i, layer in enumerate(self.layers)]
        return self._selective_cache

    def compiled_calls(self) -> list:
        """The compiled per-layer calls a training forward runs (:meth:`set_compile`; those of
        :meth:`_selective_calls` under selective checkpointing), for reporting their ``mode``; [] when not
        compiled. Raises nothing."""
        if self._compiled_layers is None:
            return []
        if self.gradient_checkpointing == "selective" and self._selective_cache is not None:
            return self._selective_cache
        return self._compiled_layers

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` → draft-vocab logits ``[..., Vd]``."""
        return self.lm_head(self.norm(h))
