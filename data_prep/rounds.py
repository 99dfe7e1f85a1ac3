"""Engine-independent regeneration: rounds over conversations (turn ``r`` conditions on the
regenerated history), the :class:`Completion` an engine returns, and the report both engines write.

Reasoning models: an engine that does not separate the reasoning (the HF engine, offline vLLM, a
vLLM server without a reasoning parser) returns the decoded text with its reasoning block, e.g.
Qwen3's ``<think>\\n…\\n</think>\\n\\nanswer``. :func:`run_rounds` splits it with the markers of the
target's own chat template (:func:`reasoning_markers`, :func:`split_reasoning`) into the assistant
message's ``reasoning`` and its answer ``content``, which is what :mod:`data_prep.template` renders
(Qwen3's ``reasoning_content``), so ``data.supervise_reasoning`` applies and earlier turns, whose
reasoning the template drops, still render their content verbatim.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from data_prep.config import RegenConfig
from data_prep.template import TemplateRefusedData, build_prompt_ids

Message = dict[str, str]


Job = tuple[int, int, list[Message], list[int]]  # (conversation index, turn, messages, prompt ids)


@dataclass
class Completion:
    """One generated assistant turn.

    ``text``: the answer (stripped), or, when the engine did not separate the reasoning, the
    whole response with its reasoning markers (split by :func:`run_rounds`); ``reasoning``: the
    reasoning text if the engine separated it (else None); ``tokens``: generated tokens (HF: up
    to and including the first end-of-turn token; a vLLM server's ``usage.completion_tokens`` or vLLM's output ids);
    ``finished``: stopped by end-of-turn, not by ``max_new_tokens``; ``token_ids``: the generated ids
    (the HF engines; None where the engine gives none); ``looped``: stopped by ``regen.stop_loops`` (unfinished,
    its answer ending in a repetition loop; the HF static engine in segments).
    """

    text: str
    reasoning: str | None
    tokens: int
    finished: bool
    token_ids: list[int] | None = None
    looped: bool = False


def run_rounds(
    complete: Callable[..., Iterable[tuple[int, Completion]]],
    tokenizer,
    conversations: list[list[Message]],
    max_prompt_tokens: int,
    progress: bool,
    desc: str = "regenerate",
    parts: list[int] | None = None,
    on_part: Callable[[int, list[list[Message]], dict], None] | None = None,
) -> tuple[list[list[Message]], dict] | list[tuple[list[list[Message]], dict]]:
    """Regenerate turn by turn over all conversations (module docstring), with any engine.

    Args:
        complete: the engine: answers jobs, yielding ``(job position, Completion)`` in any order (the HF
            engine yields batch by batch, so the progress bar moves). A *round* engine is called once per
            turn index ``r`` with that round's jobs: turn ``r + 1`` of any conversation starts only once every
            conversation's turn ``r`` is answered. A *streaming* engine (``complete.streaming`` true, e.g. the
            HF static engine in segments) is called once as ``complete(jobs, waiting)``: ``jobs`` a list and
            ``waiting`` a ``collections.deque`` of positions in it (the engine takes from its left), both
            extended here while the engine runs -- a conversation's next turn is put first as soon as its
            previous turn is yielded -- so the engine's batch stays full while any conversation has turns left
            (:func:`stream_turns`).
        tokenizer: target tokenizer (prompt-length check, :func:`build_prompt_ids`).
        conversations, max_prompt_tokens, progress: as :func:`regenerate`.
        parts: sizes of consecutive slices of ``conversations`` (summing to their number) to report apart: one
            engine run answers them all (its batch full across the slices), the result is one pair per slice.
        on_part: with ``parts``: called as ``on_part(i, kept, stats)`` as soon as every conversation of slice ``i``
            has ended (its last turn answered, or ended early), while the engine goes on with the others, so a
            caller can save a finished slice before the run ends; the same pair is in the result.

    Returns:
        ``(kept conversations, stats)``; ``stats`` holds the keyword arguments of
        :func:`regen_report` that the loop knows (``n_in``, ``n_out``, ``cut``,
        ``turns_requested``, ``counts``, ``generated_tokens``, ``seconds`` — time inside the engine,
        ``looped`` — answers the engine stopped in a loop, :attr:`Completion.looped`).
        Both kinds of engine give the same conversations and stats (but ``seconds``) for the same
        completions: each turn's prompt is its own conversation's regenerated history.
        With ``parts``: a list of such pairs, one per slice, each counting its own conversations and turns;
        a slice's ``seconds`` is the engine time from the previous slice's end (or the start) to its own end, so
        the slices' ``seconds`` add up to the run's until the last slice ended (the engine's closing after that is
        in none; slices end in any order, an empty one at the start).

    Each completion becomes ``{"role": "assistant", "content": answer, "reasoning"?: reasoning}``.
    A completion with ``reasoning=None`` is split with the template's reasoning markers
    (:func:`split_reasoning`; a template without markers keeps the text as it is). A response
    cut by ``max_new_tokens`` inside its reasoning or before any answer (no end marker, or
    reasoning with an empty answer) has no answer to learn and would render an end marker or
    end-of-turn token the model never wrote, so the tokenised masks could not be exact: the turn
    is not kept, its conversation ends there (it keeps turns ``< r``; at ``r = 0`` it is dropped)
    and it is counted as ``unfinished_reasoning`` (and, like every cut response, in
    ``unfinished_responses``). A finished response with an empty answer is ``empty_responses``.

    Raises:
        ValueError: a conversation not in normal form (names its index); ``parts`` that do not add up to the
            number of conversations.
    """
    from tqdm.auto import tqdm

    sizes = parts
    if sizes is not None and (sum(sizes) != len(conversations) or any(n < 0 for n in sizes)):
        raise ValueError(f"run_rounds: parts {sizes} must be sizes >= 0 adding up to the {len(conversations)} "
                         "conversations")
    if on_part is not None and sizes is None:
        raise ValueError("run_rounds: on_part reports slices: give parts too")
    parts = [split_turns(c, k) for k, c in enumerate(conversations)]
    out: list[list[Message]] = [list(head) for head, _ in parts]
    alive = [True] * len(parts)
    markers = reasoning_markers(tokenizer)
    zero = dict(prompts_too_long=0, empty_responses=0, unfinished_responses=0, unfinished_reasoning=0,
                turns_generated=0, looped=0, generated_tokens=0)
    per = [dict(zero) for _ in parts]  # each conversation's counts (a part's are the sum of its own)
    totals = {"generated_tokens": 0, "seconds": 0.0}
    total_turns = sum(len(users) for _, users in parts)
    bar = tqdm(total=total_turns, unit="turn", desc=desc, disable=not progress)

    # slices (``parts``): which slice each conversation is in, how many of its conversations are still going
    slice_of = [i for i, n in enumerate(sizes or [len(parts)]) for _ in range(n)]
    going = list(sizes or [len(parts)])
    done: dict[int, tuple[list[list[Message]], dict]] = {}  # finished slices' results
    clock = {"last": 0.0}  # engine seconds at the last slice's end
    settled = [False] * len(parts)

    def stats(lo: int, hi: int, seconds: float) -> tuple[list[list[Message]], dict]:
        """The kept conversations and stats of conversations ``[lo, hi)``."""
        n_turns = [(len(o) - len(h)) // 2 for o, (h, _) in zip(out[lo:hi], parts[lo:hi])]
        tot = {key: sum(p[key] for p in per[lo:hi]) for key in zero}
        kept = [o for o, n in zip(out[lo:hi], n_turns) if n > 0]
        return kept, dict(n_in=hi - lo, n_out=len(kept), turns_requested=sum(len(u) for _, u in parts[lo:hi]),
                          counts={key: tot[key] for key in zero if key not in ("looped", "generated_tokens")},
                          cut=sum(0 < n < len(u) for n, (_, u) in zip(n_turns, parts[lo:hi])),
                          generated_tokens=tot["generated_tokens"], seconds=seconds, looped=tot["looped"])

    def finish(i: int) -> None:
        """Slice ``i`` has ended: its result, with the engine time since the last slice's end, to ``on_part``."""
        lo = sum(sizes[:i])
        done[i] = stats(lo, lo + sizes[i], totals["seconds"] - clock["last"])
        clock["last"] = totals["seconds"]
        if on_part is not None:
            on_part(i, *done[i])

    def settle(k: int) -> None:
        """Conversation ``k`` has ended: its slice ends with its last conversation (reported at once)."""
        if settled[k]:
            return
        settled[k] = True
        i = slice_of[k]
        going[i] -= 1
        if going[i] == 0 and sizes is not None:
            finish(i)

    for i, n in enumerate(sizes or []):
        if n == 0:
            finish(i)  # an empty slice has ended before the engine starts

    def end(k: int, counter: str) -> None:
        per[k][counter] += 1
        alive[k] = False
        bar.update(len(parts[k][1]) - (len(out[k]) - len(parts[k][0])) // 2)  # its remaining turns
        settle(k)

    def job(k: int, r: int) -> Job | None:
        """Turn ``r`` of conversation ``k`` on its regenerated history; None (counted) when too long."""
        # role/content only: reasoning is not sent back
        msgs = [{"role": m["role"], "content": m["content"]} for m in out[k]]
        msgs.append({"role": "user", "content": parts[k][1][r]})
        try:
            ids = build_prompt_ids(tokenizer, msgs)
        except TemplateRefusedData as e:  # say which conversation and turn
            raise TemplateRefusedData(f"conversation {k}, turn {r}: {e}") from None
        if len(ids) > max_prompt_tokens:
            end(k, "prompts_too_long")
            return None
        return (k, r, msgs, ids)

    def record(k: int, r: int, c: Completion) -> bool:
        """Keep (or end the conversation on) the answer ``c`` to turn ``r`` of ``k``; True when kept."""
        totals["generated_tokens"] += c.tokens
        per[k]["generated_tokens"] += c.tokens
        per[k]["unfinished_responses"] += not c.finished
        per[k]["looped"] += c.looped
        reasoning, text, closed = c.reasoning, c.text, True
        if reasoning is None and markers is not None:
            reasoning, text, closed = split_reasoning(c.text, markers)
        if not closed or (reasoning and not text and not c.finished):
            end(k, "unfinished_reasoning")
            return False
        if not text:
            end(k, "empty_responses")
            return False
        turn = {"role": "assistant", "content": text}
        if reasoning:
            turn["reasoning"] = reasoning
        out[k] += [{"role": "user", "content": parts[k][1][r]}, turn]
        per[k]["turns_generated"] += 1
        bar.update(1)
        bar.set_postfix(tok_s=f"{totals['generated_tokens'] / max(totals['seconds'], 1e-9):.1f}", refresh=False)
        if r + 1 == len(parts[k][1]):
            settle(k)  # its last turn
        return True

    def timed(call: Callable[[], Iterable[tuple[int, Completion]]]):
        """The answers of the engine ``call()`` starts, the time spent inside the engine added to ``totals``."""
        t0 = time.perf_counter()
        it = iter(call())  # a list engine works here, a generator engine in next()
        totals["seconds"] += time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            nxt = next(it, None)
            totals["seconds"] += time.perf_counter() - t0
            if nxt is None:
                return
            yield nxt

    if getattr(complete, "streaming", False):
        stream_turns(complete, job, record, [len(users) for _, users in parts], timed)
    else:
        for r in range(max((len(u) for _, u in parts), default=0)):
            jobs = [j for k, (_, users) in enumerate(parts) if alive[k] and r < len(users)
                    for j in [job(k, r)] if j is not None]
            if jobs:
                for i, c in timed(lambda: complete(jobs)):
                    record(jobs[i][0], r, c)
    bar.close()

    if sizes is None:
        return stats(0, len(parts), totals["seconds"])
    for i in range(len(sizes)):  # an engine that stopped early: the slices not ended yet, with what they have
        if i not in done:
            finish(i)
    return [done[i] for i in range(len(sizes))]


def stream_turns(complete, job: Callable[[int, int], Job | None], record: Callable[[int, int, Completion], bool],
                 turns: list[int], timed=lambda call: call()) -> None:
    """Drive a streaming engine (:func:`run_rounds`): every conversation's first turn is waiting at the start,
    the conversations with the most turns first (then the longest prompt, then the conversation index), and
    each answered turn that ``record`` keeps puts the conversation's next turn at the *front* of the waiting
    queue before the engine asks for more work.

    Why: with rounds, a round with few long answers left (a deep multi-turn conversation, a response that runs to
    the cap) holds the whole batch back; here no conversation waits for another's turn. The order is
    longest-chain-first scheduling: a conversation's turns run one after another whatever the batch, so the
    deepest conversations start first and go on at once, alongside the bulk of single turns, instead of
    running alone at the end of the shard.

    Example: conversations A (3 turns), B, C, D (1 turn each), an engine of two places answering one job at a
    time: A1 and B1 start; A1 is answered, A2 starts before C1; B1 is answered, C1 starts; A2 is answered,
    A3 starts before D1.

    Args:
        complete: the streaming engine, called once as ``complete(jobs, waiting)``.
        job: ``(k, r) -> Job`` for turn ``r`` of conversation ``k`` on its history so far, or None (then the
            conversation has ended, counted by ``job``). record: ``(k, r, completion) -> kept``.
        turns: the number of user turns of each conversation.
        timed: ``timed(call)`` iterates the answers of ``call()``, the engine's start (run_rounds counts the
            time spent inside the engine).
    """
    from collections import deque

    jobs: list[Job] = [j for k, n in enumerate(turns) if n > 0 for j in [job(k, 0)] if j is not None]
    waiting = deque(sorted(range(len(jobs)), key=lambda i: (-turns[jobs[i][0]], -len(jobs[i][3]), jobs[i][0])))
    for i, c in timed(lambda: complete(jobs, waiting)):
        k, r = jobs[i][0], jobs[i][1]
        if record(k, r, c) and r + 1 < turns[k]:
            nxt = job(k, r + 1)
            if nxt is not None:
                jobs.append(nxt)
                waiting.appendleft(len(jobs) - 1)  # a conversation under way goes on first


#: A closing reasoning tag in a chat template's text: ``</think>`` (Qwen3, DeepSeek-R1), ``</seed:think>``.
_END_TAG = re.compile(r"</([\w:.-]*think[\w:.-]*)>")


def _template_text(tokenizer) -> str | None:
    """The tokenizer's chat template as one text (a dict of named templates joined), None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else None


def reasoning_markers(tokenizer) -> tuple[str, str] | None:
    """The ``(start, end)`` reasoning markers the tokenizer's chat template writes, or None.

    Read from the template text (``tokenizer.chat_template``, a string or a dict of named
    templates): the first closing tag whose name contains ``think`` (``</think>``) whose opening
    tag (``<think>``) is in the template too. Qwen3 gives ``("<think>", "</think>")``; ChatML,
    Llama-3 and GPT-OSS Harmony (an ``analysis`` channel, not tags) give None.
    """
    template = _template_text(tokenizer)
    if template is None:
        return None
    for m in _END_TAG.finditer(template):
        if f"<{m.group(1)}>" in template:
            return f"<{m.group(1)}>", m.group(0)
    return None


def split_reasoning(text: str, markers: tuple[str, str]) -> tuple[str | None, str, bool]:
    """Split a decoded response into ``(reasoning, answer, closed)`` at the template's markers.

    The answer is what follows the last end marker, as in the Qwen3 template's own split of a
    ``content`` holding ``</think>``; the reasoning is all that precedes it (a stray end marker
    inside stays in it), less one leading start marker (a generation prompt that already ends with
    the start marker, as DeepSeek-R1's does, leaves none); both are stripped. Cases:

    - no end marker and the text does not start with the start marker: ``(None, text, True)``;
    - ``"<think>\\nR\\n</think>\\n\\nA"``: ``("R", "A", True)`` (an empty block gives ``("", "A", True)``);
    - cut inside the reasoning (starts with the start marker, no end marker):
      ``("R…", "", False)`` -- ``closed`` is False and :func:`run_rounds` does not keep the turn.

    Args:
        text: the decoded response (special tokens removed, the markers kept).
        markers: ``(start, end)``, e.g. from :func:`reasoning_markers`.
    """
    start, end = markers
    body = text.strip()
    head, found, answer = body.rpartition(end)
    if not found:
        if body.startswith(start):
            return body[len(start):].strip(), "", False
        return None, body, True
    head = head.strip()
    if head.startswith(start):
        head = head[len(start):]
    return head.strip(), answer.strip(), True


def split_turns(conv: list[Message], k: int) -> tuple[list[Message], list[str]]:
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


def regen_report(cfg: RegenConfig, head: dict, *, n_in: int, n_out: int, cut: int, turns_requested: int,
                 counts: dict, generated_tokens: int, seconds: float, max_prompt_tokens: int,
                 eos_ids: list[int] | None, looped: int | None = None) -> dict:
    """The regeneration report shared by every backend (summed per shard by ``stages._regenerate_sharded``).

    ``head`` holds backend-specific keys placed first; ``seconds`` is generation wall time (s);
    ``tokens_per_s`` is ``generated_tokens / seconds``; ``looped`` (``regen.stop_loops`` runs only, else None
    and left out): ``looped_responses``, the answers stopped in a repetition loop (also counted as unfinished).
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
        **({} if looped is None else {"looped_responses": looped}),
    }


#: Harmony (GPT-OSS) tokens a generated assistant turn is framed by (openai/harmony, "Message format").
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


def harmony_splitter(tokenizer):
    """For a Harmony chat template (GPT-OSS): ``ids -> (reasoning, answer)`` for a generated turn (None for
    ids without any ``<|channel|>``: not Harmony-formatted, decoded as plain text by the caller); None for
    any other template.

    A Harmony turn is a sequence of messages, each ``<|channel|>NAME<|message|>TEXT`` closed by ``<|end|>``
    (another message follows, after ``<|start|>assistant``) or by ``<|return|>`` / ``<|call|>`` (the turn
    ends); the generation prompt already wrote the first ``<|start|>assistant``. The ``analysis``
    channel's texts (joined by a blank line; None when there is none) are the reasoning, the last
    ``final`` channel's text the answer ("" when there is none); a message cut by the cap counts with
    the text it has. Decoding on the special ids keeps the channel structure that
    ``skip_special_tokens`` loses (``"analysisUser asks 2+2.assistantfinal4"``). Source: the Harmony
    format as the GPT-OSS chat template writes it (``peagle_train/data/chat_templates``, where
    ``message.thinking`` renders as the analysis message). :func:`run_rounds` then ends a turn cut in its
    reasoning (no answer, not finished) as ``unfinished_reasoning`` and one with no answer as
    ``empty_responses``, as for ``<think>`` templates.

    Example: ``<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final
    <|message|>4<|return|>`` → ``("User asks 2+2.", "4")``.
    """
    template = _template_text(tokenizer)
    vocab = tokenizer.get_vocab()
    if template is None or "<|channel|>" not in template or any(t not in vocab for t in HARMONY_TOKENS):
        return None
    ids = {t: vocab[t] for t in HARMONY_TOKENS}
    closers = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]}

    def split(token_ids: list[int]) -> tuple[str | None, str] | None:
        if ids["<|channel|>"] not in token_ids:
            return None  # no Harmony message at all (e.g. a random-weight target): the caller decodes plainly
        messages, channel, body, state = [], [], [], "header"
        for t in list(token_ids) + [ids["<|end|>"]]:  # a trailing closer: a message cut by the cap counts too
            if t == ids["<|channel|>"]:
                channel, body, state = [], [], "channel"
            elif t == ids["<|message|>"]:
                state = "body" if state == "channel" else state
            elif t in closers or t == ids["<|start|>"]:
                if state == "body":
                    name = tokenizer.decode(channel).split()
                    messages.append((name[0] if name else "", tokenizer.decode(body).strip()))
                state = "header"
            elif state == "channel":
                channel.append(t)
            elif state == "body":
                body.append(t)
        analysis = [text for name, text in messages if name == "analysis"]
        final = [text for name, text in messages if name == "final"]
        return ("\n\n".join(analysis) if analysis else None), (final[-1] if final else "")

    return split
