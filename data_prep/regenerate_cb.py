"""The ``continuous`` engine of the HF backend: transformers' continuous batching (paged attention).

Every prompt of a round is submitted at once to a ``ContinuousBatchingManager``
(``model.init_continuous_batching``); its scheduler keeps up to ``regen.batch_size`` sequences in the
running batch, admits a waiting prompt as soon as one finishes, and keeps the KV cache in blocks of
:data:`~data_prep.regen_memory.PAGE_TOKENS` tokens, so a short answer never waits for the longest one
of its batch and no memory goes to padding. Results are yielded as they finish (the progress bar
moves). Only API present in transformers 5.17 and 5.24 is used: ``init_continuous_batching``,
``warmup``/``start``/``add_request``/``get_result``/``stop``/``destroy`` and the
``ContinuousBatchingConfig`` keys ``num_blocks``, ``max_batch_tokens``, ``max_memory_percent``,
``max_requests_per_batch``, ``seed`` and ``drop_unsupported_processors`` (False: an unsupported
processor is kept, and refused here).

Greedy output is token-identical to plain ``generate`` on the same prompts (float32, CPU:
``tests/unit/test_regen_engines.py``; on a GPU ``benchmarks/regen_throughput.py`` counts it).
Sampling (``regen.do_sample``) uses the same temperature / top-p (top-k off) through transformers'
logits processors, seeded with ``regen.seed``; sampled text is not expected to equal ``generate``'s
(other random draws). A logits processor continuous batching cannot run (e.g. one from the model's
``generation_config``) is an error, never silently dropped.
"""
from __future__ import annotations

import copy
import math

from data_prep.config import RegenConfig
from data_prep.regen_memory import PAGE_TOKENS

#: Tokens in one forward on CPU when ``regen.max_batch_tokens`` is unset (transformers would size it from
#: the machine's whole RAM).
CPU_MAX_BATCH_TOKENS = 512


def unsupported_reason(model) -> str | None:
    """Why continuous batching cannot run ``model`` (None when it can): transformers without it, or a model
    whose attention does not go through transformers' attention interface (``_supports_attention_backend``)."""
    if not hasattr(model, "init_continuous_batching"):
        return "this transformers version has no continuous batching (model.init_continuous_batching)"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not support transformers' attention backends (paged attention)"
    return None


def generation_config(model, cfg: RegenConfig, eos_ids: list[int], pad_id: int):
    """The model's ``generation_config`` updated as plain ``generate`` would be by the backend's keyword
    arguments (``max_new_tokens``, ``do_sample``, sampling: ``temperature``, ``top_p``, ``top_k=0``)."""
    gc = copy.deepcopy(model.generation_config)
    gc.update(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample, eos_token_id=list(eos_ids),
              pad_token_id=pad_id)
    if cfg.do_sample:
        gc.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    return gc


def continuous_generate(model, prompts: list[list[int]], cfg: RegenConfig, eos_ids: list[int], pad_id: int):
    """Generate for every prompt with continuous batching; yields ``(prompt index, new token ids, finished)``
    as each finishes (ids up to and including the end-of-turn token; ``finished``: it ended with one).

    The manager lives for this call (one per round and shard); leaving early (an error, the consumer
    closing the generator) stops it at once, failing what is in flight.

    Raises:
        ValueError: continuous batching cannot run this model (:func:`unsupported_reason`), or the
            generation settings need a logits processor it does not support.
        RuntimeError: a request failed inside the engine, or its thread stopped (names the request and
            says to use ``regen.engine: generate``).
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    if not prompts:
        return
    why = unsupported_reason(model)
    if why is not None:
        raise ValueError(f"regen.engine: continuous: {why}; use regen.engine: generate (or auto)")
    longest = max(len(p) for p in prompts)
    num_blocks, max_batch_tokens = cfg.kv_blocks, cfg.max_batch_tokens
    if model.device.type == "cpu":  # transformers would size both from the whole RAM
        if num_blocks is None:
            num_blocks = min(cfg.batch_size, len(prompts)) * math.ceil((longest + cfg.max_new_tokens) / PAGE_TOKENS) + 1
        max_batch_tokens = max_batch_tokens or CPU_MAX_BATCH_TOKENS
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, max_memory_percent=cfg.kv_memory_fraction,
        max_requests_per_batch=cfg.batch_size, seed=cfg.seed, drop_unsupported_processors=False)
    hints = WorkloadHints(max_prompt_length=longest, max_generated_length=cfg.max_new_tokens,
                          num_requests=len(prompts))
    try:
        manager = model.init_continuous_batching(generation_config=generation_config(model, cfg, eos_ids, pad_id),
                                                 continuous_batching_config=cb_config, workload_hints=hints)
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"regen.engine: continuous cannot run these generation settings ({e}); use regen.engine: "
                         "generate") from e
    kept = getattr(getattr(manager, "logit_processor", None), "logits_processor", None) or []
    unsupported = [type(lp).__name__ for lp in kept if getattr(lp, "supports_continuous_batching", None) is False]
    if unsupported:
        _close(manager, model, hard=True)
        raise ValueError(f"regen.engine: continuous cannot apply the logits processor(s) {', '.join(unsupported)} "
                         "(from the model's generation_config or the regen settings); use regen.engine: generate")
    done = False
    try:
        if model.device.type == "cuda":
            manager.warmup()  # captures CUDA graphs where transformers uses them
        manager.start()
        for i, p in enumerate(prompts):
            manager.add_request(list(p), request_id=str(i), max_new_tokens=cfg.max_new_tokens, eos_token_id=list(eos_ids))
        pending, eos = set(range(len(prompts))), set(eos_ids)
        while pending:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"continuous batching stopped with {len(pending)} request(s) unanswered; "
                                       "see the log above, or use regen.engine: generate")
                continue
            if not out.is_finished():
                continue
            i = int(out.request_id)
            if out.error is not None:
                raise RuntimeError(f"continuous batching failed on prompt {i} of this round ({out.error}); "
                                   "use regen.engine: generate")
            pending.discard(i)
            new = list(out.generated_tokens)
            stop = next((t for t, tok in enumerate(new) if tok in eos), None)
            yield i, (new if stop is None else new[: stop + 1]), stop is not None
        done = True
    finally:
        _close(manager, model, hard=not done)


def _close(manager, model, hard: bool) -> None:
    """Stop ``manager`` (``hard``: fail what is in flight instead of finishing it), release it, and give
    the model back its own attention implementation (``stop`` restores it only for a started manager)."""
    if manager.is_running():
        manager.stop(block=True, hard_stop=hard)
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        model.set_attn_implementation(original)
        manager._original_attn_impl = None
    manager.destroy()
