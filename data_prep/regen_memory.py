"""Will a regeneration fit in memory? Checked before the first token is generated, so a cap or batch
size the accelerator cannot hold is reduced or refused with a message instead of failing hours in.

The KV cache dominates: ``layers × 2 (K and V) × kv_heads × head_dim × dtype bytes`` per token
(:func:`kv_bytes_per_token`), read from the target's config. The worst case of one sequence is
``data.max_prompt_tokens + regen.max_new_tokens`` tokens. Plain ``generate`` holds ``batch_size`` such
sequences (its cache grows to the longest one in the batch) plus one step of float32 logits per
sequence (engine ``static``: the same, its prompt length rounded up to the bucket it is padded to), and
while a batch's prompts are prefilled, that forward's own transient tensors (:func:`prefill_bytes_per_row`:
above all the ``[B, heads, P, P]`` scores of eager attention, which GPT-OSS runs for its attention sinks,
and a mixture of experts' routed activations);
continuous batching holds what its block pool holds (``regen.kv_blocks`` blocks of
:data:`PAGE_TOKENS` tokens, or a fraction of the free memory) and schedules within it, so only a pool
smaller than one sequence, or larger than the free memory, is wrong. Free memory: the accelerator's
free bytes (``torch.cuda.mem_get_info``), on CPU the available RAM (``MemAvailable``).
"""
from __future__ import annotations

import math

from data_prep.config import RegenConfig
from data_prep.kv_carry import PREFILL_ROWS_DIVISOR, memory_caches
from data_prep.target_memory import TargetShape, target_forward_peak_bytes

#: Tokens per KV-cache block of transformers' continuous batching (its default page/block size, 256 in
#: transformers 5.17 ``block_size`` and 5.24 ``page_size``).
PAGE_TOKENS = 256
#: engine ``static``: prompts are left-padded to a multiple of this many tokens, so the static cache (prompt +
#: ``max_new_tokens``) and the compiled decoding step see a few shapes per run, not one per batch.
STATIC_PROMPT_BUCKET = 128
#: engine ``static`` in segments (``regen.segment_tokens``): a call's rows are left-padded to a multiple of
#: ``max(this, segment)`` tokens, so that the lengths a compiled decoding step meets over a whole run stay few
#: (at most 8 for a 2,048-token prompt limit and a 2,048-token cap), each compiled once
SEGMENT_LENGTH_BUCKET = 512
#: engine ``static`` in segments: a call decodes at least this share of ``regen.batch_size`` rows (padded with
#: copies of its first row), so that a round's last rows do not meet a new batch shape at every halving
SEGMENT_MIN_WIDTH_SHARE = 8


def bucketed(n: int, bucket: int) -> int:
    """``n`` rounded up to a multiple of ``bucket`` (tokens; ``bucket`` >= 1)."""
    return -(-n // bucket) * bucket


def segment_bucket(bucket: int, segment: int) -> int:
    """The length multiple a segmented static call pads its rows to: ``max(bucket, segment,``
    :data:`SEGMENT_LENGTH_BUCKET` ``)`` tokens (``bucket``: the engine's prompt bucket)."""
    return max(bucket, segment, SEGMENT_LENGTH_BUCKET)


def segment_width(rows: int, batch_size: int) -> int:
    """Rows a segmented static call decodes: ``rows`` rounded up to a power of two, at least
    ``batch_size //`` :data:`SEGMENT_MIN_WIDTH_SHARE` (rounded up to a power of two), at most ``batch_size``.

    Example: ``batch_size`` 512: 300 rows -> 512, 100 -> 128, 3 -> 64."""
    low = 1 << max(0, batch_size // SEGMENT_MIN_WIDTH_SHARE - 1).bit_length()
    return min(batch_size, max(low, 1 << max(0, rows - 1).bit_length()))


#: Share of the free memory the check lets the KV cache (and logits) take: the rest is activations,
#: the allocator's fragmentation and the sampler's temporaries.
HEADROOM = 0.9
GIB = 1024 ** 3


class RegenMemoryError(ValueError):
    """The regeneration settings cannot fit the memory (names the keys, the figures and the fix)."""


def _text_config(config):
    """The text model's config of a (possibly multimodal) transformers config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in every layer: ``layers × 2 × kv_heads × head_dim × dtype_bytes``.

    Args:
        config: the target's transformers config (its text config is used for a multimodal one).
        dtype_bytes: bytes per cached element (the model's dtype: 4 for float32, 2 for bfloat16).
    """
    text = _text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(text.num_hidden_layers) * 2 * int(kv_heads) * int(head_dim) * int(dtype_bytes)


def free_memory_bytes(device) -> int | None:
    """Free bytes where the cache will live: CUDA ``mem_get_info`` of ``device`` plus what PyTorch's caching
    allocator holds in this process but does not use (``memory_reserved - memory_allocated``: freed tensors
    whose blocks it keeps for reuse, which ``mem_get_info`` counts as used); CPU: ``MemAvailable`` of
    ``/proc/meminfo``; None where unknown (another accelerator, no ``/proc``).

    Why the allocator's share: after an earlier ``generate`` in the same process (a benchmark's warm-up run)
    the driver alone saw 62.9 of the H200's 139 GiB free, and the check cut a batch of 512 to 459."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(0, int(cached))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def prefill_bytes_per_row(model_config, dtype_bytes: int, prompt_tokens: int, attn_implementation: str | None) -> int:
    """Transient bytes one prompt row of ``prompt_tokens`` adds to the prefill forward of ``generate``: the
    peak of a target forward (:func:`data_prep.target_memory.target_forward_peak_bytes`, the
    same counting of transformers' Llama and GPT-OSS forwards) with no tapped layers and only the last
    position's logits (``logits_to_keep=1``). Linear in the batch, so a batch of B rows adds B times this.

    Args:
        model_config: the target's transformers config (text config of a multimodal one).
        dtype_bytes: bytes per element of the model's dtype. prompt_tokens: P, the padded prompt length.
        attn_implementation: the model's (``eager`` materialises ``[heads, P, P + 1]`` scores per row,
            ``EAGER_SCORE_COPIES`` at once; ``sdpa``/flash/flex do not).

    Returns:
        bytes per row (int); raises nothing (an unknown attention implementation counts as not eager).

    Example (GPT-OSS-20B in bf16, eager, P = 2,048): 1.72 GB per row, of which 3 score copies of 0.54 GB;
    a batch of 64 needs 110 GB for the prefill alone, more than an H200 has beside the 42 GB of weights.
    """
    shape = TargetShape.from_config(_text_config(model_config), dtype_bytes=dtype_bytes, weight_bytes=0,
                                    attn_implementation=attn_implementation, aux_layers=0)
    return target_forward_peak_bytes(1, prompt_tokens, shape, head_chunk=0)


def static_row_tokens(cfg: RegenConfig, max_prompt_tokens: int) -> tuple[int, int]:
    """``(prompt, seq)``: the longest prompt a call of the static engine prefills for one row and the static cache
    length that row needs, in tokens (the memory check counts every row at ``seq``).

    In segments (``regen.segment_tokens``) a row goes on with its prompt and its tokens so far (fewer than the
    cap), bucketed to :func:`segment_bucket`, plus one segment (at most the cap); without, the bucketed prompt plus
    the cap. E.g. SmolLM2's GPU recipe (prompts of 2,048, cap 2,048, segments of 512): ``(4096, 4608)``.
    ``regen.keep_kv`` makes every cache ``seq`` long from its first call (one cache length: the compiled
    decoding step meets one length per batch width, not one per longer row)."""
    if cfg.segment_tokens is not None:
        prompt = bucketed(max_prompt_tokens + cfg.max_new_tokens - 1,
                          segment_bucket(STATIC_PROMPT_BUCKET, cfg.segment_tokens))
        return prompt, prompt + min(cfg.segment_tokens, cfg.max_new_tokens)
    prompt = bucketed(max_prompt_tokens, STATIC_PROMPT_BUCKET)
    return prompt, prompt + cfg.max_new_tokens


def fit_regen_memory(cfg: RegenConfig, model_config, dtype_bytes: int, engine: str, max_prompt_tokens: int,
                     free_bytes: int | None, where: str = "the device",
                     attn_implementation: str | None = None) -> tuple[RegenConfig, str | None]:
    """The regeneration settings that fit ``free_bytes``, and a message when they had to change.

    Args:
        cfg: the ``regen`` section (``max_new_tokens``, ``batch_size``, ``kv_blocks``).
        model_config, dtype_bytes: the target's config and cache element size (:func:`kv_bytes_per_token`).
        engine: ``"generate"``, ``"static"`` or ``"continuous"`` (resolved, not ``auto``).
        max_prompt_tokens: the longest prompt a turn may have (``data.max_prompt_tokens``).
        free_bytes: free memory where the cache lives (:func:`free_memory_bytes`); None skips the check.
        where: the device, for the message (``"cuda:0"``).
        attn_implementation: the model's attention (``model.config._attn_implementation``): engines
            ``generate`` and ``static`` also count the prefill's transient bytes (:func:`prefill_bytes_per_row`).

    Returns:
        ``(cfg, message)``: ``cfg`` itself and None when it fits; otherwise a copy with ``batch_size``
        (generate) or ``kv_blocks`` (continuous) reduced to what fits, and a message saying so.

    Raises:
        RegenMemoryError: not even one sequence of ``max_prompt_tokens + max_new_tokens`` tokens fits;
            or ``kv_blocks`` hold fewer tokens than one such sequence.
    """
    per_token = kv_bytes_per_token(model_config, dtype_bytes)
    seq = max_prompt_tokens + cfg.max_new_tokens
    vocab = int(getattr(_text_config(model_config), "vocab_size", 0) or 0)
    shape = (f"(data.max_prompt_tokens {max_prompt_tokens} + regen.max_new_tokens {cfg.max_new_tokens} tokens × "
             f"{per_token:,} KV bytes/token)")
    if engine == "continuous" and cfg.kv_blocks is not None and cfg.kv_blocks * PAGE_TOKENS < seq:
        raise RegenMemoryError(
            f"regen.kv_blocks={cfg.kv_blocks} holds {cfg.kv_blocks * PAGE_TOKENS:,} tokens, fewer than one sequence "
            f"needs {shape}: raise regen.kv_blocks to at least {math.ceil(seq / PAGE_TOKENS)}, or lower "
            "regen.max_new_tokens / data.max_prompt_tokens")
    if free_bytes is None:
        return cfg, None
    usable = int(free_bytes * HEADROOM)
    free = f"{free_bytes / GIB:.2f} GiB free on {where}"
    if engine in ("generate", "static"):
        prompt = max_prompt_tokens
        if engine == "static":  # in segments a row goes on with its tokens so far; the cache holds a segment more
            prompt, seq = static_row_tokens(cfg, max_prompt_tokens)
        prefill = prefill_bytes_per_row(model_config, dtype_bytes, prompt, attn_implementation)
        # regen.keep_kv: the cache is rebuilt in place; a prefill forward's rows, the continued turns' frames and two
        # layers beside it at the peak (data_prep.kv_carry.memory_caches)
        keep_kv = engine == "static" and cfg.segment_tokens is not None and cfg.keep_kv
        caches = memory_caches(_text_config(model_config).num_hidden_layers, cfg.batch_size,
                               cfg.keep_kv_frames) if keep_kv else 1
        if keep_kv:  # its prefill forwards take at most an eighth of the call's rows (generate's own: one position)
            prefill = prefill * max(1, cfg.batch_size // PREFILL_ROWS_DIVISOR) // cfg.batch_size
        per_seq = int(caches * seq * per_token) + vocab * 4 + prefill  # KV cache(s), one step of fp32 logits, prefill
        need = cfg.batch_size * per_seq
        if need <= usable:
            return cfg, None
        fits = usable // per_seq
        what = (f"{shape}{f' in {caches:.3g} caches (regen.keep_kv)' if caches > 1 else ''} and its prefill "
                f"({prefill / GIB:.2f} GiB per row"
                + (", eager attention scores" if attn_implementation == "eager" else "") + ")")
        if fits < 1:
            raise RegenMemoryError(
                f"one sequence {what} needs {per_seq / GIB:.2f} GiB, more than {HEADROOM:.0%} of the {free}: lower "
                "regen.max_new_tokens or data.max_prompt_tokens, or use a larger device")
        return cfg.model_copy(update={"batch_size": int(fits)}), (
            f"regen.batch_size {cfg.batch_size} × {what} needs {need / GIB:.2f} GiB, more than "
            f"{HEADROOM:.0%} of the {free}: regenerating with batch_size {fits} instead")
    pool = int(free_bytes * (cfg.kv_memory_fraction or HEADROOM))  # what continuous batching's cache may take
    if cfg.kv_blocks is None and seq * per_token > pool:
        raise RegenMemoryError(
            f"one sequence {shape} needs {seq * per_token / GIB:.2f} GiB of KV cache, more than "
            f"{cfg.kv_memory_fraction or HEADROOM:.0%} of the {free}: lower regen.max_new_tokens or "
            "data.max_prompt_tokens, raise regen.kv_memory_fraction, or use a larger device")
    if cfg.kv_blocks is None or cfg.kv_blocks * PAGE_TOKENS * per_token <= usable:
        return cfg, None
    fits = usable // (PAGE_TOKENS * per_token)
    if fits * PAGE_TOKENS < seq:
        raise RegenMemoryError(
            f"regen.kv_blocks {cfg.kv_blocks}: the {free} hold {fits} blocks of {PAGE_TOKENS} tokens, fewer than one "
            f"sequence needs {shape}: lower regen.max_new_tokens or data.max_prompt_tokens, or use a larger device")
    return cfg.model_copy(update={"kv_blocks": int(fits)}), (
        f"regen.kv_blocks {cfg.kv_blocks} ({cfg.kv_blocks * PAGE_TOKENS * per_token / GIB:.2f} GiB at "
        f"{per_token:,} KV bytes/token) is more than {HEADROOM:.0%} of the {free}: using kv_blocks {fits} instead")
