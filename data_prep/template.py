"""Chat-template tokenisation with an assistant-only loss mask.

Rule: the loss mask is 1 on every token the target produces in an assistant turn -- the
content and the end-of-turn token that closes it (``<|im_end|>`` in ChatML,
``<|eot_id|>`` in Llama-3), since the drafter must learn to stop -- and 0 on system and
user text, on role headers (the generation prompt, e.g. ``<|im_start|>assistant\\n``) and
on whitespace the template writes after the end-of-turn token. This is the
"assistant tokens only" rule of TRL's ``assistant_only_loss`` and FastChat's
``preprocess``, derived here from the tokenizer's own template instead of template markup.
Tested with the real ChatML (SmolLM2), Llama-3, Qwen3 and GPT-OSS Harmony templates.

Reasoning (``supervise_reasoning``, recipe key ``data.supervise_reasoning``): an assistant
message may carry ``"reasoning"``; it is passed to the template as Qwen3's ``reasoning_content``
and GPT-OSS's ``thinking``. When true, everything the model writes after the generation prompt
is learned (Qwen3 ``<think>…</think>\\n\\n`` + answer; Harmony ``<|channel|>analysis<|message|>…
<|end|><|start|>assistant<|channel|>final<|message|>`` + answer); when false, only the answer
content and its end-of-turn token. Both templates drop the reasoning of earlier turns (it is
never an input at inference), so only the last turn's reasoning can be learned.

Method (exact, template-agnostic). With ``R(msgs, gen)`` the template's text and ``ids(text)`` its
tokenisation without added special tokens (the template writes BOS itself, as
``apply_chat_template(tokenize=True)`` does), ``F = R(messages, gen=False)``; for each assistant
message ``i``:

1. ``P_i = R(messages[:i], gen=True)`` (history + assistant header) must be a prefix of ``F``
   (prefix-stable history); the turn's supervised text starts at ``len(P_i)``.
2. Its content must appear verbatim in ``F`` after ``P_i`` and before the next user message
   (the last occurrence there is taken); the supervised text ends with the content, and the
   next token must be an added/special token (the end-of-turn token), which is learned too.
3. The char positions are mapped to tokens by tokenising the prefixes ``F[:pos]``: each must be
   a prefix of ``ids(F)`` (the tokenizer does not merge across the boundary), and its length is
   the token index. A cut for truncation may fall after the end-of-turn token and the
   whitespace-only tokens the template writes after it.

Worked example (SmolLM2, ChatML, one turn ``user "Hi"`` / ``assistant "Hello"``)::

    F = "<|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n"
    P_1 ends at "…assistant\\n"; content "Hello" is followed by the special token <|im_end|>
    mask = 0 … 0 | 1 ("Hello") 1 ("<|im_end|>") | 0 ("\\n")

Sources: TRL ``assistant_only_loss`` / FastChat ``preprocess`` (assistant tokens only); Qwen3 and
GPT-OSS templates (``tokenizer_config.json`` / ``chat_template.jinja``) for reasoning rendering.
"""
from __future__ import annotations

from typing import Literal

from data_prep.sharegpt import DataError

Message = dict[str, str]


class TemplateError(DataError):
    """The target's chat template or tokenizer does not allow an exact assistant mask, or does not
    render at all (a template that does not compile or fails on a message): bad input for this
    target, so a :class:`DataError` (the console script prints it and exits 2). The message names the
    template and the assistant message, and says what to do."""


class TemplateRefusedData(TemplateError):
    """The target's chat template itself raised on a conversation (Jinja ``raise_exception``, e.g.
    Gemma's "System role not supported", or a template error such as a ``TypeError`` on one message);
    names the message index and role."""


#: What to do about a template that cannot give the exact mask or does not render.
TEMPLATE_FIX = ("fix the template (chat_template.jinja, or the chat_template field of tokenizer_config.json, "
                "in the target's folder) or use a target whose template does")


def _template_name(tokenizer) -> str:
    """'the chat template of <name or path>', or "the target's chat template" when unnamed."""
    name = getattr(tokenizer, "name_or_path", None)
    return f"the chat template of '{name}'" if name else "the target's chat template"


def _mask_error(tokenizer, i: int, problem: str) -> TemplateError:
    """The error for assistant message ``i`` whose exact mask ``problem`` prevents, naming the template."""
    return TemplateError(f"{_template_name(tokenizer)}: assistant message {i}: {problem}")


def _refused(tokenizer, messages: list[dict], err: Exception) -> TemplateRefusedData:
    """The error for a template that raised ``err`` on ``messages``: finds the first message whose
    prefix the template refuses (its index and role) and gives the fix (a template's own
    ``raise_exception`` refuses the data; any other error is the template's to fix)."""
    import jinja2

    j = len(messages) - 1
    for k in range(len(messages)):
        try:
            tokenizer.apply_chat_template(messages[: k + 1], tokenize=False, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 -- any failure of the template on this prefix locates it
            j = k
            break
    role = messages[j]["role"] if messages else None
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    if type(err) is not jinja2.TemplateError:  # not raise_exception: the template fails on this message
        fix = TEMPLATE_FIX
    elif role == "system":
        fix = ("set data.fold_system_into_user: true (folds the system message into the first user turn), "
               "or use data without system messages")
    else:
        fix = "use data whose roles this template accepts, or a target whose template does"
    return TemplateRefusedData(
        f"{_template_name(tokenizer)} raised {type(err).__name__}: {err} on message {j} (role {role!r}) of the "
        f"conversation whose first user turn starts {first_user[:60]!r}; {fix}"
    )


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    """``apply_chat_template(messages, tokenize=False)``; the template's failures as :class:`TemplateError`.

    Raises:
        TemplateError: the tokenizer has no chat template, the template does not compile (Jinja
            ``TemplateSyntaxError``, with its line) or returns no string.
        TemplateRefusedData: the template raised while rendering ``messages`` (its own
            ``raise_exception`` or any other error); names the message index and role.
    """
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 -- with tokenize=False only the template runs: its failures are bad input
        import jinja2

        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{_template_name(tokenizer)} is missing: the tokenizer has no chat template; "
                                f"{TEMPLATE_FIX}") from e
        if isinstance(e, jinja2.TemplateSyntaxError):
            raise TemplateError(f"{_template_name(tokenizer)} does not compile: {type(e).__name__}: {e.message} "
                                f"(template line {e.lineno}); {TEMPLATE_FIX}") from e
        raise _refused(tokenizer, messages, e) from e
    if not isinstance(text, str):
        raise TemplateError(f"{_template_name(tokenizer)}: apply_chat_template(tokenize=False) returned "
                            f"{type(text).__name__}, expected str; {TEMPLATE_FIX}")
    return text


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def build_prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of ``messages`` rendered with the assistant header appended.

    Renders ``apply_chat_template(messages, add_generation_prompt=True)`` and tokenises it
    without added special tokens, the same path as :func:`tokenize_conversation`, so a
    prompt is exactly a prefix of the training ids of the conversation that continues it.

    Returns:
        list[int] of prompt token ids (length = prompt tokens).

    Raises:
        TemplateRefusedData: the template raised on the conversation (see :func:`tokenize_conversation`).
    """
    return _ids(tokenizer, [_render(tokenizer, _template_messages(messages), True)])[0]


def _first_diff(a: str, b: str) -> str:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"char {n}: {a[n:n + 40]!r} vs {b[n:n + 40]!r}"


def _template_messages(messages: list[Message]) -> list[dict]:
    """Messages as the templates expect them: ``reasoning`` becomes Qwen3's ``reasoning_content``
    and GPT-OSS's ``thinking`` (each template reads its own key and ignores the other)."""
    out = []
    for m in messages:
        t = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning"):
            t["reasoning_content"] = t["thinking"] = m["reasoning"]
        out.append(t)
    return out


def _added_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's added (special/control) tokens, end-of-turn markers among them.
    Built once per conversation: ``get_added_vocab()`` rebuilds and sorts a dict on every call."""
    return set(tokenizer.added_tokens_decoder)


def tokenize_conversation(
    tokenizer,
    messages: list[Message],
    max_length: int,
    overlong: Literal["truncate", "drop"],
    supervise_reasoning: bool = True,
    report: dict | None = None,
) -> dict | None:
    """Tokenise a conversation with the tokenizer's chat template and an assistant-only loss mask.

    Args:
        tokenizer: a Hugging Face (fast or slow) tokenizer with a chat template.
        messages: ``[{"role", "content"}]`` with at least one assistant message (contents
            should be stripped, see :mod:`data_prep.sources`); an assistant message may carry
            ``"reasoning"`` (its chain of thought, rendered by Qwen3 as ``<think>`` and by
            GPT-OSS as the ``analysis`` channel).
        max_length: longest allowed sequence in tokens.
        overlong: ``"truncate"`` cuts after the last assistant turn whose end fits in
            ``max_length``; ``"drop"`` drops.
        supervise_reasoning: learn the reasoning tokens of a turn (True) or only its answer
            content and end-of-turn token (False). Turns whose reasoning the template does not
            render (Qwen3 and GPT-OSS drop it from earlier turns) have none to learn.
        report: optional dict; ``reasoning_dropped_by_template`` is incremented per such turn.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int]}`` of equal length L <= max_length,
        loss_mask in {0, 1} (rule and method in the module docstring); or None when
        overlong and dropped, or when not even the first assistant turn fits.

    Raises:
        TemplateError: (a :class:`DataError`) the history is not prefix-stable, the template does
            not render an assistant content verbatim, no special end-of-turn token follows it, or
            the tokenizer merges text across a span boundary (names the template, the assistant
            message index and the fix); the template does not compile or is missing.
        TemplateRefusedData: the template raised on the conversation (e.g. a system role it does
            not support, or a Jinja/Python error on one message; names the template, the message
            index and role, and the fix).
        ValueError: no assistant message; unknown ``overlong`` policy.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop' (got {overlong!r})")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("tokenize_conversation: the conversation has no assistant message")
    msgs = _template_messages(messages)
    full = _render(tokenizer, msgs, False)

    spans = []  # per turn: (message index, supervised char start, content char end)
    for t, i in enumerate(turns):
        prompt = _render(tokenizer, msgs[:i], True)
        if not full.startswith(prompt):
            raise _mask_error(tokenizer, i, (
                f"the template is not prefix-stable: the history before this turn, rendered with the generation "
                f"prompt, is not a prefix of the whole conversation's render ({_first_diff(prompt, full)}); the "
                f"exact assistant mask needs a template that renders the history the same whatever follows; "
                f"{TEMPLATE_FIX}"))
        s = len(prompt)
        # the turn ends before the next user message (rendered the same, prefix-stable history)
        region_end = len(full)
        if i + 1 < len(messages):
            upto = _render(tokenizer, msgs[: i + 2], False)
            nxt = upto.rfind(messages[i + 1]["content"]) if full.startswith(upto) else -1
            region_end = nxt if nxt >= s else region_end
        content = messages[i]["content"]
        c = full.rfind(content, s, region_end)
        if c < 0:
            raise _mask_error(tokenizer, i, (
                "the template does not render its content verbatim after the assistant header; the exact mask "
                "needs the content as written (reasoning left inside the content, e.g. <think>...</think>, "
                f"belongs in the message's reasoning field); {TEMPLATE_FIX}"))
        start = s
        reasoning = messages[i].get("reasoning")
        if reasoning:
            rendered = full.rfind(reasoning.strip(), s, c) >= 0
            if not rendered and report is not None:
                report["reasoning_dropped_by_template"] = report.get("reasoning_dropped_by_template", 0) + 1
            if rendered and not supervise_reasoning:
                start = c
        spans.append((i, start, c + len(content)))

    ids = _ids(tokenizer, [full])[0]
    cuts = sorted({p for _, a, b in spans for p in (a, b)})
    prefixes = dict(zip(cuts, _ids(tokenizer, [full[:p] for p in cuts])))
    tok_at = {}
    for p, part in prefixes.items():
        if ids[: len(part)] != part:
            i = next(i for i, a, b in spans if p in (a, b))
            what = "header" if any(p == a for _, a, _b in spans) else "end-of-turn token"
            raise _mask_error(tokenizer, i, (
                f"the tokenizer merges text across the {what} boundary (the prefix's {len(part)} tokens are not "
                f"a prefix of the conversation's tokens); strip leading/trailing whitespace from message contents"))
        tok_at[p] = len(part)
    mask = [0] * len(ids)
    boundaries = []
    added = _added_ids(tokenizer)
    for i, a, b in spans:
        start, stop = tok_at[a], tok_at[b]
        if stop >= len(ids) or ids[stop] not in added:
            found = tokenizer.convert_ids_to_tokens(ids[stop]) if stop < len(ids) else "the end"
            raise _mask_error(tokenizer, i, f"no special end-of-turn token follows its content (found {found}); "
                                            f"{TEMPLATE_FIX}")
        stop += 1  # the end-of-turn token is learned: the drafter must learn to stop
        if stop <= start:
            raise _mask_error(tokenizer, i, f"the template renders no tokens for it; {TEMPLATE_FIX}")
        mask[start:stop] = [1] * (stop - start)
        end = stop  # a cut may keep whitespace the template writes after the end-of-turn token
        while end < len(ids) and ids[end] not in added and not tokenizer.decode([ids[end]]).strip():
            end += 1
        boundaries.append(end)

    if len(ids) > max_length:
        if overlong == "drop":
            return None
        fitting = [b for b in boundaries if b <= max_length]
        if not fitting:
            return None
        ids, mask = ids[: fitting[-1]], mask[: fitting[-1]]
    return {"input_ids": ids, "loss_mask": mask}
