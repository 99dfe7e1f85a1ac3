"""The target's answers to evaluation prompt sets, for the in-training walk on them (``train.eval_walk_sets``).

The trainer's walk (``eval_walk_al``, :class:`~peagle_train.trainer.evaluation.InTrainingEval`) replays the
decoding loop from the training grid's predictions on sequences whose answers are the target's own greedy
output; on the eval split that output is the regeneration's. For the sets ``peagle-train eval`` measures
(MT-Bench, HumanEval, Arena-Hard) this module makes it: the target answers the first ``eval.num_prompts`` prompts
of each set greedily, MT-Bench's second turns too when ``eval.both_turns`` (on the history of its own first
answer cut at ``eval.max_new_tokens``, as the loop's history is), each prompt rendered by the target's chat
template as the loop renders it (:func:`data_prep.template.build_prompt_ids`). The trainer then logs
``eval_walk_al_sets`` (AL per served K, per set) beside ``eval_walk_al_heldout``: a learning curve on the
evaluation's own prompts without running the loop (issue 20: HumanEval is the set that lags).

An answer runs ``extra_tokens`` past ``eval.max_new_tokens`` (the trainer passes ``train.K + 1``): the loop's last
round verifies drafts beyond the horizon, and the walk needs their labels
(``tests/unit/test_speculative.py::test_walked_training_predictions_equal_the_decoding_loop``). An answer ends at the
target's end token, so a last round whose drafts run past it is walked short (the loop may count drafts there that
the walk has no labels for), as on the eval split.

Answers are decoded in batches (left-padded, one ``generate`` call per batch and turn), so that they cost seconds
on a GPU, not the loop's minutes; batched and single-sequence greedy decoding agree up to the target dtype's
rounding (equal in float64: ``tests/unit/test_walk_sets.py``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import GenerationConfig

#: ``(name, n) -> prompts``: each prompt the list of its user turns (:func:`data_prep.eval_prompts.load_eval_prompts`)
PromptLoader = Callable[[str, int], list[list[str]]]


def greedy_answers(target, prompts: list[list[int]], max_new_tokens: int, eos: list[int] | None,
                   batch_size: int = 64) -> list[list[int]]:
    """The target's greedy continuation of each prompt, batched.

    Args:
        target: :class:`~peagle_train.features.target.Target` (its model on the device it runs on).
        prompts: token id lists (any lengths; left-padded inside a batch, masked).
        max_new_tokens: the most tokens generated per prompt.
        eos: end-of-sequence ids (:func:`peagle_train.features.target.eos_ids`): an answer ends with the first of
            them, which it keeps (the loop verifies the end token too); None: every answer runs to the cap.
        batch_size: prompts per ``generate`` call.

    Returns:
        One list of int token ids per prompt, ``1 <= len <= max_new_tokens``, in the order given.

    Raises:
        ValueError: an empty prompt or ``max_new_tokens < 1``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: need at least 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_answers: an empty prompt (a chat template always renders the user turn)")
    model = target.model
    device = next(model.parameters()).device
    pad = eos[0] if eos else 0
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s:s + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        att = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            att[r, width - len(p):] = 1
        # eagerly: the trainer compiles the online target's layers for its training shapes (train.compile_target),
        # and decoding's one-token steps over a growing cache would recompile them
        # a bare GenerationConfig in place of the target's own for the call (generate merges the model's into one
        # passed to it): plain greedy whatever the target asks (a repetition penalty, suppressed tokens), as the
        # decoding loop takes the argmax of the logits
        plain = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=pad)
        own = model.generation_config
        model.generation_config = plain
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), generation_config=plain)
        finally:
            model.generation_config = own
        for row in gen[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if eos and t in eos), len(row))
            out.append(row[:cut])
    return out


def reference_sequences(target, names: list[str], num_prompts: int, max_new_tokens: int, both_turns: bool,
                        extra_tokens: int, load_prompts: PromptLoader | None = None,
                        encode: Callable[[list[dict]], list[int]] | None = None,
                        batch_size: int = 64) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per set, ``(prompt ids, answer ids)`` of every sequence the decoding loop measures (module docstring).

    Args:
        target: :class:`~peagle_train.features.target.Target` with its tokenizer.
        names: evaluation sets (``mt_bench``, ``humaneval``, ``arena_hard``).
        num_prompts, max_new_tokens, both_turns: as ``eval.*`` (the loop's prompts, horizon and turns).
        extra_tokens: answer tokens generated past ``max_new_tokens`` (the walk's last round needs them).
        load_prompts: ``(name, n) -> prompts`` (default :func:`data_prep.eval_prompts.load_eval_prompts`).
        encode: user/assistant message history -> prompt ids (default: the target's chat template,
            :func:`data_prep.template.build_prompt_ids`, as the eval stage).

    Returns:
        ``{name: [(prompt_ids, answer_ids), ...]}``, turn-1 sequences first, then the second turns in prompt
        order; ``len(answer) <= max_new_tokens + extra_tokens``.

    Raises:
        ValueError: a set name without prompts, ``extra_tokens < 0``; the loaders' errors (a missing data file).
    """
    from data_prep.template import build_prompt_ids
    from peagle_train.features.target import eos_ids

    if extra_tokens < 0:
        raise ValueError(f"extra_tokens={extra_tokens}: need >= 0")
    if load_prompts is None:
        from data_prep.eval_prompts import load_eval_prompts as load_prompts
    encode = encode or (lambda messages: build_prompt_ids(target.tokenizer, messages))
    eos = eos_ids(target)
    out: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name in names:
        prompts = load_prompts(name, num_prompts)
        if not prompts:
            raise ValueError(f"eval set {name!r}: no prompts")
        turns = [p[: 2 if both_turns else 1] for p in prompts]
        seqs: list[tuple[list[int], list[int]]] = []
        histories: list[list[dict]] = [[] for _ in turns]
        for t in range(max(map(len, turns))):
            rows = [i for i, tt in enumerate(turns) if len(tt) > t]
            for i in rows:
                histories[i].append({"role": "user", "content": turns[i][t]})
            ids = [list(encode(histories[i])) for i in rows]
            answers = greedy_answers(target, ids, max_new_tokens + extra_tokens, eos, batch_size)
            for i, p, a in zip(rows, ids, answers):
                seqs.append((p, a))
                shown = [x for x in a[:max_new_tokens] if not eos or x not in eos]  # the loop's history: its reference
                histories[i].append({"role": "assistant",
                                     "content": target.tokenizer.decode(shown, skip_special_tokens=True)})
        out[name] = seqs
    return out
