"""Peak bytes of one forward of a frozen target, from its configuration: what regeneration's prefill
(``data_prep.regen_memory``) and the online trainer's feature forward (``peagle_train.peagle.planner``,
which re-exports these names) add on top of the target's weights.

Counted from transformers 5's GPT-OSS and Llama forwards (eager attention's score tensors, a mixture of
experts' routed activations, the head's logits chunk) and checked against the live tensors of GPT-OSS-20B's
forward on the meta device (``tests/unit/test_planner_online.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

#: Score-sized ``[B, nh, n, n + 1]`` tensors alive at once in GPT-OSS's eager attention (transformers'
#: ``eager_attention_forward``): the scaled and masked scores, their concatenation with the sink column, that
#: minus its row maximum, then the softmax (the scores freed only when the softmax exists).
EAGER_SCORE_COPIES = 3


@dataclass(frozen=True)
class TargetShape:
    """A target as the memory models see it (the online trainer's planner, regeneration's prefill check).

    Attributes:
        hidden_size: T. intermediate_size: I (per expert for a mixture of experts). num_heads, num_kv_heads,
        head_dim: attention. vocab_size: V. experts_per_token: k, 0 for a dense MLP. dtype_bytes: b, bytes
        per element of the target's dtype (2 for bf16). weight_bytes: its parameters on this device (bytes).
        eager_attention: transformers' ``eager`` attention, which materialises the scores (flash, SDPA and
        flex attention do not). mask_kinds: distinct ``layer_types`` (GPT-OSS: full and sliding, 2); eager
        attention builds one ``[B, 1, n, n]`` mask per kind. aux_layers: A, the tapped layers.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    experts_per_token: int = 0
    dtype_bytes: int = 2
    weight_bytes: int = 0
    eager_attention: bool = False
    mask_kinds: int = 1
    aux_layers: int = 3

    @classmethod
    def from_config(cls, cfg, *, dtype_bytes: int, weight_bytes: int, attn_implementation: str | None,
                    aux_layers: int = 3) -> "TargetShape":
        """From the target's transformers config (``experts_per_token`` from ``num_experts_per_tok``; 0 if absent)."""
        T, nh = cfg.hidden_size, cfg.num_attention_heads
        return cls(T, cfg.intermediate_size, nh, getattr(cfg, "num_key_value_heads", None) or nh,
                   getattr(cfg, "head_dim", None) or T // nh, cfg.vocab_size,
                   getattr(cfg, "num_experts_per_tok", None) or 0, dtype_bytes, weight_bytes,
                   attn_implementation == "eager", len(set(getattr(cfg, "layer_types", None) or ["full"])), aux_layers)

    def mlp_elements(self) -> int:
        """Elements per token alive at the MLP's peak: GPT-OSS's experts (transformers' default ``grouped_mm``
        path), per routed (token, expert) pair the gathered input (T), the gathered ``gate_up`` bias and the
        ``gate_up`` output (2I each) and the clamped SwiGLU's five I-wide intermediates: ``k (T + 9 I)``;
        a dense SwiGLU MLP (Llama): ``act(gate)``, ``up`` and their product, ``3 I``."""
        if self.experts_per_token:
            return self.experts_per_token * (self.hidden_size + 9 * self.intermediate_size)
        return 3 * self.intermediate_size


def target_forward_peak_bytes(B: int, n: int, t: TargetShape, head_chunk: int | None = 4096) -> int:
    """Peak bytes one :meth:`~peagle_train.features.target.Target.features` call allocates for ``B`` right-padded
    rows of ``n`` tokens (``M = B n``; weights not included), the largest of its three phases, ``b = dtype_bytes``::

        attention = M b ((A + 3) T + (3 nh + 2 nkv) hd) + 3 scores + masks
        mlp       = M b ((A + 4) T + mlp_elements)     + 1 scores + masks
        head      = M b (2 A + 1) T + rows V b,   rows = min(head_chunk, M) + B  (M when head_chunk is None)
        scores    = B nh n (n + 1) b,  masks = mask_kinds B n^2 b   (eager attention; 0 otherwise)

    Per token: the embedding output (kept by the model's forward), the A taps (hooks), the decoder layer's
    input and the normed input (the MLP phase also the residual after attention), q after RoPE and the k, v
    heads repeated to nh (eager path, an upper bound for the fused kernels). The eager path holds
    ``EAGER_SCORE_COPIES`` score tensors at its peak and still one (the probabilities the layer returns)
    during the MLP. The head phase: taps + ``last`` + their concatenation ``aux`` (``2A + 1`` rows of T),
    one chunk of the head's logits in the target's dtype (``Target.greedy_tokens``: argmax per chunk of
    ``head_chunk`` positions, no float32 upcast, no softmax) and the model's own last-position logits
    ``[B, 1, V]`` (``logits_to_keep=1``); a sharded head (``train.target_sharding: shard``) builds every
    position's logits instead (``head_chunk=None``). Left out (under 0.1 % at the GPT-OSS-20B shape): RoPE
    tables, router logits and indices, row maxima. Counted from transformers 5's GPT-OSS and Llama forwards,
    checked against the live tensors of GPT-OSS-20B's forward on the meta device (within 0.1 % in each
    phase, ``tests/unit/test_planner_online.py``); another transformers version or architecture may differ.

    Example (GPT-OSS-20B, bf16, eager, B = 1, n = 8,192): attention 0.50 GB + 3 x 8.59 GB + 0.27 GB =
    26.54 GB (the live tensors of a meta-device forward: 26.54 GB); mlp 2.22 + 8.59 + 0.27 = 11.08 GB;
    head 0.33 + 1.65 = 1.98 GB.
    """
    M, b, T, A = B * n, t.dtype_bytes, t.hidden_size, t.aux_layers
    scores = B * t.num_heads * n * (n + 1) * b if t.eager_attention else 0
    masks = t.mask_kinds * B * n * n * b if t.eager_attention else 0
    qkv = (3 * t.num_heads + 2 * t.num_kv_heads) * t.head_dim
    attention = M * b * ((A + 3) * T + qkv) + EAGER_SCORE_COPIES * scores + masks
    mlp = M * b * ((A + 4) * T + t.mlp_elements()) + scores + masks
    head = M * b * (2 * A + 1) * T + (M if head_chunk is None else min(head_chunk, M) + B) * t.vocab_size * b
    return max(attention, mlp, head)


def largest_fitting_batch(n: int, t: TargetShape, budget_bytes: int, cap: int, head_chunk: int | None = 4096) -> int:
    """The most right-padded rows of ``n`` tokens (at most ``cap``) whose forward fits ``budget_bytes`` beside
    the weights: the largest ``B <= cap`` with ``target_forward_peak_bytes(B, n, t) <= budget_bytes``, 0 if not
    even one row fits. The transient grows with ``B``, so this is a binary search. Pure.

    Example (GPT-OSS-20B, bf16, eager; the H200's OOM of the feature cache at ``regen.batch_size`` 64): at
    n = 3,880 one row's forward holds 6.08 GB (three ``[64, n, n + 1]`` score tensors of 1.93 GB), so a budget
    of 0.9 x 150.75 GB - 41.83 GB of weights = 93.85 GB takes 15 rows, not 64 (389 GB).

    Raises:
        ValueError: ``n`` or ``cap`` below 1.
    """
    if n < 1 or cap < 1:
        raise ValueError(f"largest_fitting_batch: n={n} and cap={cap} must be >= 1")
    lo, hi = 0, cap  # invariant: lo rows fit (0 trivially), more than hi rows are not asked for
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if target_forward_peak_bytes(mid, n, t, head_chunk) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
