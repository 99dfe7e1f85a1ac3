"""Chat-template tokenisation with an assistant-only loss mask.

Rule: the loss mask is 1 on every token the target produces in an assistant turn -- the
content and the end-of-turn token that closes it (``<|im_end|>`` in ChatML,
``<|eot_id|>`` in Llama-3), since the drafter must learn to stop -- and 0 on system and
user text, on role headers (the generation prompt, e.g. ``<|im_start|>assistant\\n``) and
on whitespace the template writes after the end-of-turn token. This is the
"assistant tokens only" rule of TRL's ``assistant_only_loss`` and FastChat's
``preprocess``, derived here from the tokenizer's own template instead of template markup.

Method (exact, template-agnostic). With ``R(msgs, gen)`` the template's text and
``ids(text)`` its tokenisation without added special tokens (the template writes BOS
itself, as ``apply_chat_template(tokenize=True)`` does), for each assistant message ``i``::

    P_i = R(messages[:i],   gen=True)    # history + assistant header
    Q_i = R(messages[:i+1], gen=False)   # through the end of turn i
    F   = R(messages,       gen=False)

The template must be prefix-stable, ``P_i ⊑ Q_i ⊑ F`` as text, and the tokenizer must not
merge across those boundaries: ``ids(P_i)``, ``ids(Q_i.rstrip())`` and ``ids(Q_i)`` must be
prefixes of ``ids(F)``. Then turn ``i`` is masked on ``[len ids(P_i), len ids(Q_i.rstrip()))``
and ``len ids(Q_i)`` is a turn boundary where truncation may cut. Worked example (SmolLM2,
ChatML, one turn ``user "Hi"`` / ``assistant "Hello"``)::

    F = "<|im_start|>system\\n…<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n"
    P_1 ends at "…assistant\\n"; Q_1.rstrip() ends at "Hello<|im_end|>"
    mask = 0 … 0 | 1 ("Hello") 1 ("<|im_end|>") | 0 ("\\n")
"""
from __future__ import annotations

from typing import Literal

Message = dict[str, str]


class TemplateError(ValueError):
    """The chat template or tokenizer does not allow an exact assistant mask."""


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
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
    """
    return _ids(tokenizer, [_render(tokenizer, messages, True)])[0]


def _first_diff(a: str, b: str) -> str:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"char {n}: {a[n:n + 40]!r} vs {b[n:n + 40]!r}"


def tokenize_conversation(
    tokenizer,
    messages: list[Message],
    max_length: int,
    overlong: Literal["truncate", "drop"],
) -> dict | None:
    """Tokenise a conversation with the tokenizer's chat template and an assistant-only loss mask.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{"role", "content"}]`` with at least one assistant message
            (contents should be stripped, see :mod:`data_prep.sources`).
        max_length: longest allowed sequence in tokens.
        overlong: ``"truncate"`` cuts after the last assistant turn whose end (as
            ``R(messages[:i+1])`` renders it) fits in ``max_length``; ``"drop"`` drops.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int]}`` of equal length L <= max_length,
        loss_mask in {0, 1} (rule and method in the module docstring); or None when
        overlong and dropped, or when not even the first assistant turn fits.

    Raises:
        TemplateError: the template is not prefix-stable, or the tokenizer merges text
            across a turn boundary (names the message index and the difference).
        ValueError: no assistant message; unknown ``overlong`` policy.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop' (got {overlong!r})")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("tokenize_conversation: the conversation has no assistant message")

    full = _render(tokenizer, messages, False)
    texts = [full]
    for i in turns:
        prompt = _render(tokenizer, messages[:i], True)
        turn = _render(tokenizer, messages[: i + 1], False)
        for a, b, what in ((prompt, turn, f"R(messages[:{i}], gen=True)"), (turn, full, f"R(messages[:{i + 1}])")):
            if not b.startswith(a):
                raise TemplateError(
                    f"chat template is not prefix-stable: {what} is not a prefix of the longer render "
                    f"({_first_diff(a, b)}); the exact assistant mask needs a template that renders earlier "
                    f"turns the same whatever follows"
                )
        texts += [prompt, turn.rstrip(), turn]

    all_ids = _ids(tokenizer, texts)
    ids = all_ids[0]
    mask = [0] * len(ids)
    boundaries = []  # token index just after each assistant turn
    for t, i in enumerate(turns):
        start, stop, end = (len(x) for x in all_ids[1 + 3 * t : 4 + 3 * t])
        for part, what in zip(all_ids[1 + 3 * t : 4 + 3 * t], ("header", "end-of-turn token", "turn end")):
            if ids[: len(part)] != part:
                raise TemplateError(
                    f"assistant message {i}: the tokenizer merges text across the {what} boundary (the "
                    f"prefix's {len(part)} tokens are not a prefix of the conversation's tokens); strip "
                    f"leading/trailing whitespace from message contents"
                )
        if stop <= start:
            raise TemplateError(f"assistant message {i}: the template renders no tokens for it")
        mask[start:stop] = [1] * (stop - start)
        boundaries.append(end)

    if len(ids) > max_length:
        if overlong == "drop":
            return None
        fitting = [b for b in boundaries if b <= max_length]
        if not fitting:
            return None
        ids, mask = ids[: fitting[-1]], mask[: fitting[-1]]
    return {"input_ids": ids, "loss_mask": mask}
