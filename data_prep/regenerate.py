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
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from peagle_train.config import RegenConfig

from .template import build_prompt_ids

Message = dict[str, str]
Job = tuple[int, int, list[Message], list[int]]  # (conversation index, turn, messages, prompt ids)


@dataclass
class Completion:
    """One generated assistant turn.

    ``text``: the answer (stripped); ``reasoning``: the reasoning text if the engine
    separated it (else None); ``tokens``: generated tokens (HF: up to and including the first
    end-of-turn token; a vLLM server's ``usage.completion_tokens`` or vLLM's output ids);
    ``finished``: stopped by end-of-turn, not by ``max_new_tokens``.
    """

    text: str
    reasoning: str | None
    tokens: int
    finished: bool


def run_rounds(
    complete: Callable[[list[Job]], Iterable[tuple[int, Completion]]],
    tokenizer,
    conversations: list[list[Message]],
    max_prompt_tokens: int,
    progress: bool,
    desc: str = "regenerate",
) -> tuple[list[list[Message]], dict]:
    """Regenerate turn by turn over all conversations (module docstring), with any engine.

    Args:
        complete: the engine: answers a round's jobs, yielding ``(job position, Completion)``
            in any order (the HF engine yields batch by batch, so the progress bar moves).
        tokenizer: target tokenizer (prompt-length check, :func:`build_prompt_ids`).
        conversations, max_prompt_tokens, progress: as :func:`regenerate`.

    Returns:
        ``(kept conversations, stats)``; ``stats`` holds the keyword arguments of
        :func:`regen_report` that the loop knows (``n_in``, ``n_out``, ``cut``,
        ``turns_requested``, ``counts``, ``generated_tokens``, ``seconds`` — time inside the engine).

    Raises:
        ValueError: a conversation not in normal form (names its index).
    """
    from tqdm.auto import tqdm

    parts = [_split(c, k) for k, c in enumerate(conversations)]
    out: list[list[Message]] = [list(head) for head, _ in parts]
    alive = [True] * len(parts)
    counts = dict(prompts_too_long=0, empty_responses=0, unfinished_responses=0, turns_generated=0)
    generated_tokens, seconds = 0, 0.0
    total_turns = sum(len(users) for _, users in parts)
    bar = tqdm(total=total_turns, unit="turn", desc=desc, disable=not progress)

    def end(k: int, counter: str) -> None:
        counts[counter] += 1
        alive[k] = False
        bar.update(len(parts[k][1]) - (len(out[k]) - len(parts[k][0])) // 2)  # its remaining turns

    for r in range(max((len(u) for _, u in parts), default=0)):
        jobs: list[Job] = []
        for k, (_, users) in enumerate(parts):
            if alive[k] and r < len(users):
                # role/content only: reasoning is not sent back
                msgs = [{"role": m["role"], "content": m["content"]} for m in out[k]]
                msgs.append({"role": "user", "content": users[r]})
                ids = build_prompt_ids(tokenizer, msgs)
                if len(ids) > max_prompt_tokens:
                    end(k, "prompts_too_long")
                else:
                    jobs.append((k, r, msgs, ids))
        if not jobs:
            continue
        t0 = time.perf_counter()
        answers = iter(complete(jobs))  # a list engine works here, a generator engine in next()
        seconds += time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            nxt = next(answers, None)
            seconds += time.perf_counter() - t0
            if nxt is None:
                break
            i, c = nxt
            k = jobs[i][0]
            generated_tokens += c.tokens
            counts["unfinished_responses"] += not c.finished
            if not c.text:
                end(k, "empty_responses")
            else:
                turn = {"role": "assistant", "content": c.text}
                if c.reasoning:
                    turn["reasoning"] = c.reasoning
                out[k] += [{"role": "user", "content": parts[k][1][r]}, turn]
                counts["turns_generated"] += 1
                bar.update(1)
            bar.set_postfix(tok_s=f"{generated_tokens / max(seconds, 1e-9):.1f}", refresh=False)
    bar.close()

    n_turns = [(len(o) - len(h)) // 2 for o, (h, _) in zip(out, parts)]
    kept = [o for o, n in zip(out, n_turns) if n > 0]
    return kept, dict(n_in=len(conversations), n_out=len(kept), turns_requested=total_turns, counts=counts,
                      cut=sum(0 < n < len(u) for n, (_, u) in zip(n_turns, parts)),
                      generated_tokens=generated_tokens, seconds=seconds)


def _split(conv: list[Message], k: int) -> tuple[list[Message], list[str]]:
    """(leading system message(s), user contents) of a normal-form conversation.

    Raises:
        ValueError: roles other than ``system? (user assistant)* user?``, naming conversation ``k``.
    """
    head = conv[:1] if conv and conv[0]["role"] == "system" else []
    rest = conv[len(head):]
    expected = ["user", "assistant"] * ((len(rest) + 1) // 2)
    if [m["role"] for m in rest] != expected[: len(rest)] or not rest:
        raise ValueError(
            f"conversation {k}: expected an optional system message then alternating user/assistant "
            f"messages starting with a user message (got roles {[m['role'] for m in conv]})"
        )
    return head, [m["content"] for m in rest if m["role"] == "user"]


def _eos_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the model's ``generation_config.eos_token_id`` (int or list) plus the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither model.generation_config nor the tokenizer defines an eos token id")
    return ids


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


def regen_report(cfg: RegenConfig, head: dict, *, n_in: int, n_out: int, cut: int, turns_requested: int,
                 counts: dict, generated_tokens: int, seconds: float, max_prompt_tokens: int,
                 eos_ids: list[int] | None) -> dict:
    """The regeneration report shared by every backend (summed per shard by ``stages._regenerate_sharded``).

    ``head`` holds backend-specific keys placed first; ``seconds`` is generation wall time (s);
    ``tokens_per_s`` is ``generated_tokens / seconds``.
    """
    return {
        **head,
        "conversations_in": n_in,
        "conversations_out": n_out,
        "conversations_dropped": n_in - n_out,
        "conversations_cut": cut,
        "turns_requested": turns_requested,
        **counts,
        "generated_tokens": generated_tokens,
        "generate_seconds": round(seconds, 3),
        "tokens_per_s": round(generated_tokens / seconds, 2) if seconds > 0 else None,
        "max_prompt_tokens": max_prompt_tokens,
        "eos_token_ids": eos_ids,
        "sampling": {
            "do_sample": cfg.do_sample,
            "temperature": cfg.temperature if cfg.do_sample else None,
            "top_p": cfg.top_p if cfg.do_sample else None,
            "max_new_tokens": cfg.max_new_tokens,
            "batch_size": cfg.batch_size,
            "seed": cfg.seed,
        },
    }


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
        content decoded with ``skip_special_tokens=True`` and stripped; the report has
        counts (``conversations_in/out/dropped/cut``, ``turns_requested/generated``,
        ``prompts_too_long``, ``empty_responses``, ``unfinished_responses`` -- stopped by
        ``max_new_tokens``), ``generated_tokens`` (including each end-of-turn token),
        ``generate_seconds``, ``tokens_per_s`` and the ``sampling`` settings.

    ``cfg.backend == "vllm"`` dispatches to :func:`data_prep.regenerate_vllm.regenerate_vllm`
    (OpenAI-compatible server at ``regen.server_url``, or offline ``vllm.LLM``), which
    returns a report with the same keys (and raises its own errors, documented there).

    Raises:
        ValueError: ``cfg.enabled`` is false; a conversation not in normal form.
    """
    if cfg.backend == "vllm":
        from .regenerate_vllm import regenerate_vllm

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

    def complete(jobs: list[Job]):
        """Longest prompts first (ties by conversation index), left-padded batches of ``batch_size``."""
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][3]))
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            for i, (new, finished) in zip(idx, _generate_batch(model, [jobs[i][3] for i in idx], pad_id, eos_ids,
                                                                 gen_kwargs)):
                yield i, Completion(tokenizer.decode(new, skip_special_tokens=True).strip(), None, len(new), finished)

    kept, stats = run_rounds(complete, tokenizer, conversations, max_prompt_tokens, progress)
    report = regen_report(cfg, {"backend": "hf"}, **stats, max_prompt_tokens=max_prompt_tokens, eos_ids=eos_ids)
    return kept, report
