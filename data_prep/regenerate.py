"""Regenerate every assistant turn with the target (Hugging Face ``generate`` backend;
``regen.backend: vllm`` is dispatched to :mod:`data_prep.regenerate_vllm`).

Drafters learn the target's own distribution best when trained on the target's own
responses (EAGLE-3 / P-EAGLE recipes regenerate UltraChat/ShareGPT answers with the
target). Turns are regenerated in rounds: round ``r`` builds, for every conversation
still alive, the prompt ``system? + (user_1, regenerated_1, ..., user_r)`` with the
target's chat template (:func:`data_prep.template.build_prompt_ids`), so turn ``r``
conditions on the *regenerated* history. Within a round prompts are sorted by length
(longest first, ties by conversation index) and generated in left-padded batches of
``RegenConfig.batch_size``.

A conversation whose round-``r`` prompt exceeds ``max_prompt_tokens``, or whose
response is empty, ends there: it keeps turns ``< r`` or, at ``r = 0``, is dropped; both
are counted in the report, never raised.

Reasoning models (Qwen3): ``generate`` writes the reasoning block into the text
(``<think>\\n…\\n</think>\\n\\nanswer``); it is decoded with its markers kept and
:func:`data_prep.rounds.run_rounds` splits it into the message's ``reasoning`` and answer
``content`` with the markers of the target's own chat template; a response cut inside its
reasoning ends its conversation (``unfinished_reasoning``).
"""
from __future__ import annotations

from data_prep.config import RegenConfig
from data_prep.regenerate_vllm import regenerate_vllm
from data_prep.rounds import Completion, Job, Message, reasoning_markers, regen_report, run_rounds


def _eos_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the model's ``generation_config.eos_token_id`` (int or list) plus the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither model.generation_config nor the tokenizer defines an eos token id")
    return ids


def _decoder(tokenizer):
    """``ids -> text`` for a generated turn: ``decode(skip_special_tokens=True)``, stripped, except
    that the chat template's reasoning markers (:func:`data_prep.rounds.reasoning_markers`) are kept
    when the tokenizer makes them special tokens, so the reasoning can be split from the answer
    (Qwen3's ``<think>``/``</think>`` are plain added tokens and survive either way)."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    keep = {vocab[m] for m in reasoning_markers(tokenizer) or () if m in vocab} & special
    if not keep:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()
    return lambda ids: tokenizer.decode([t for t in ids if t not in special or t in keep]).strip()


def _generate_batch(model, prompts: list[list[int]], pad_id: int, eos_ids: list[int], gen_kwargs: dict):
    """Left-pad ``prompts`` and generate.

    Returns:
        list of (new token ids up to and including the first eos, finished: bool) per prompt.
    """
    import torch

    B, L = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L), 0 on left padding
    for b, p in enumerate(prompts):
        input_ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, L - len(p):] = 1
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        pad_token_id=pad_id,
        eos_token_id=eos_ids,
        **gen_kwargs,
    )  # (B, L + T_new)
    results = []
    eos = set(eos_ids)
    for row in out[:, L:].tolist():
        stop = next((t for t, tok in enumerate(row) if tok in eos), None)
        results.append((row if stop is None else row[: stop + 1], stop is not None))
    return results


def regenerate(
    model,
    tokenizer,
    conversations: list[list[Message]],
    cfg: RegenConfig,
    max_prompt_tokens: int,
    progress: bool = True,
) -> tuple[list[list[Message]], dict]:
    """Replace every assistant turn by the target's own response to the regenerated history.

    Args:
        model: a Hugging Face causal LM (put in eval mode here); inputs go to ``model.device``.
        tokenizer: its tokenizer, with a chat template.
        conversations: normal-form conversations (:mod:`data_prep.sources`): an optional
            system message, then alternating user/assistant messages starting with a user
            message. Assistant contents are ignored; a trailing user message is answered too.
        cfg: backend, ``max_new_tokens`` (per turn), ``do_sample``, ``temperature``, ``top_p``
            (sampling uses only these: HF's default top-k of 50 is disabled), ``batch_size``,
            ``seed`` (``transformers.set_seed`` once at the start; sampled output is
            reproducible for the same inputs, batch size and device).
        max_prompt_tokens: a prompt (tokens, including the assistant header) longer than
            this ends its conversation (counted, not raised).
        progress: show a tqdm bar (turns, with generated tokens/s).

    Returns:
        ``(conversations, report)``: the surviving conversations in input order, each turn's
        content decoded with ``skip_special_tokens=True`` and stripped -- with a reasoning
        template (Qwen3 ``<think>``) only the answer, the reasoning in the message's
        ``reasoning`` (module docstring); the report has
        counts (``conversations_in/out/dropped/cut``, ``turns_requested/generated``,
        ``prompts_too_long``, ``empty_responses``, ``unfinished_responses`` -- stopped by
        ``max_new_tokens``, ``unfinished_reasoning`` -- stopped inside the reasoning, turn not
        kept), ``generated_tokens`` (including each end-of-turn token),
        ``generate_seconds``, ``tokens_per_s`` and the ``sampling`` settings.

    ``cfg.backend == "vllm"`` dispatches to :func:`data_prep.regenerate_vllm.regenerate_vllm`
    (OpenAI-compatible server at ``regen.server_url``, or offline ``vllm.LLM``), which
    returns a report with the same keys (and raises its own errors, documented there).

    Raises:
        ValueError: ``cfg.enabled`` is false; a conversation not in normal form.
    """
    if cfg.backend == "vllm":

        return regenerate_vllm(model, tokenizer, conversations, cfg, max_prompt_tokens, progress)
    if not cfg.enabled:
        raise ValueError("regen.enabled is false: skip regenerate() and keep the source responses")
    import transformers

    transformers.set_seed(cfg.seed)
    model.eval()
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    gen_kwargs = {"max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.do_sample}
    if cfg.do_sample:
        gen_kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)

    decode = _decoder(tokenizer)

    def complete(jobs: list[Job]):
        """Longest prompts first (ties by conversation index), left-padded batches of ``batch_size``.
        The text keeps any reasoning block (``reasoning=None``): ``run_rounds`` splits it."""
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][3]))
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            for i, (new, finished) in zip(idx, _generate_batch(model, [jobs[i][3] for i in idx], pad_id, eos_ids,
                                                                 gen_kwargs)):
                yield i, Completion(decode(new), None, len(new), finished)

    kept, stats = run_rounds(complete, tokenizer, conversations, max_prompt_tokens, progress)
    report = regen_report(cfg, {"backend": "hf"}, **stats, max_prompt_tokens=max_prompt_tokens, eos_ids=eos_ids)
    return kept, report
