"""How much of the target's own greedy output on the eval prompts a lookup in its context predicts.

    python benchmarks/eval_repetition.py RECIPE [--sets mt_bench humaneval] [--prompts N] [--max-new-tokens N]
                                         [--both-turns | --no-both-turns] [--override KEY=VALUE ...] [--out REPORT.json]
                                         [--answers-out ANSWERS.json]

(defaults: the recipe's ``eval.num_prompts``, ``eval.max_new_tokens`` and ``eval.both_turns``)

The acceptance length of a drafter is measured on what the target generates. A small target's greedy
answers fall into loops, and a loop's continuation can be copied from the context at every depth, so the
share of such text in the evaluation sets a large part of the acceptance length, whatever the drafter
learned elsewhere (issue 20). This script decodes the eval prompts with the target alone, greedily, as the
eval stage's reference does (``peagle_train.decoding.speculative.target_generate``, the recipe's chat template,
EOS ends an answer), and reports per set the copyable share of the answers by their position
(``benchmarks/repetition_report.py``'s buckets and rule: ``data_prep.loops.copyable_flags``, n = 4, the prompt
counting as context), the mean answer length and how many answers ended at EOS. It needs no drafter.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from repetition_report import split_report  # noqa: E402


def answers_report(prompts: list[list[str]], encode: Callable[[list[dict]], list[int]],
                   generate: Callable[[list[int]], list[int]], decode: Callable[[list[int]], str],
                   eos: list[int] | None, both_turns: bool, keep: list | None = None) -> dict:
    """The repetition report (:func:`repetition_report.split_report`) of the target's answers to ``prompts``.

    Args:
        prompts: per prompt its user turns (``data_prep.eval_prompts.load_eval_prompts``).
        encode: chat history (``[{"role", "content"}]``) -> prompt token ids.
        generate: prompt ids -> the target's greedy new token ids (EOS included when it ended there).
        decode: ids -> text (a turn-1 answer in turn 2's history, as the eval stage asks turn 2).
        eos: end-of-turn token ids (None: none); an answer's EOS is not counted as a token.
        both_turns: also each prompt's second user turn, after the target's own first answer.
        keep: when given, one ``{"prompt", "turn", "prompt_ids", "answer_ids"}`` per answer is appended to it, in
            decoding order (prompt index, then turn, both from 0; ``answer_ids`` with its EOS when it ended there).

    Returns:
        ``split_report``'s dict over all answers (each answer supervised, its prompt as unsupervised context) plus
        ``mean_answer_tokens`` and ``ended_at_eos`` (answers that stopped at EOS before the cap).
    """
    ids_all, masks, lens, ended = [], [], [], 0
    for pi, turns in enumerate(prompts):
        history: list[dict] = []
        for ti, user in enumerate(turns[: 2 if both_turns else 1]):
            history.append({"role": "user", "content": user})
            ids = list(encode(history))
            ref = list(generate(ids))
            if keep is not None:
                keep.append({"prompt": pi, "turn": ti, "prompt_ids": ids, "answer_ids": ref})
            stop = bool(eos) and bool(ref) and ref[-1] in eos
            ended += stop
            answer = ref[:-1] if stop else ref
            ids_all.append(ids + answer)
            masks.append([0] * len(ids) + [1] * len(answer))
            lens.append(len(answer))
            history.append({"role": "assistant", "content": decode(answer)})
    rep = split_report({"input_ids": ids_all, "loss_mask": masks})
    return rep | {"mean_answer_tokens": round(sum(lens) / max(1, len(lens)), 1), "ended_at_eos": ended}


def main(argv: list[str] | None = None) -> dict:
    """The command line (module docstring): prints one line per set, writes ``--out`` atomically, returns the report.

    Raises: ConfigError / TargetLoadError from the recipe or its target; FileNotFoundError from an eval set's loader.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--sets", nargs="+", default=["mt_bench", "humaneval"])
    ap.add_argument("--prompts", type=int, default=None, help="prompts per set (default: the recipe's eval.num_prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's eval.max_new_tokens")
    ap.add_argument("--both-turns", action=argparse.BooleanOptionalAction, default=None,
                    help="MT-Bench's second turns too, after the target's answer (default: the recipe's eval.both_turns)")
    ap.add_argument("--override", nargs="*", default=[], help="recipe overrides, e.g. target.dtype=float32")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--answers-out", type=Path, default=None,
                    help="also the token ids of every prompt and answer, per set (benchmarks/acceptance_by_copyable.py)")
    a = ap.parse_args(argv)
    from data_prep.eval_prompts import load_eval_prompts
    from data_prep.template import build_prompt_ids
    from peagle_train.core.atomic import write_json_atomic
    from peagle_train.decoding.speculative import target_generate
    from peagle_train.eval.evaluate import eos_ids
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    cfg = load_config(a.recipe, a.override)
    a.prompts = cfg.eval.num_prompts if a.prompts is None else a.prompts
    a.max_new_tokens = cfg.eval.max_new_tokens if a.max_new_tokens is None else a.max_new_tokens
    a.both_turns = cfg.eval.both_turns if a.both_turns is None else a.both_turns
    target = load_target(cfg.target)
    eos = eos_ids(target)
    res = {"command": "python benchmarks/eval_repetition.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "commit": os.environ.get("PEAGLE_COMMIT"), "recipe": a.recipe, "target": cfg.target.name,
           "device": str(target.device), "max_new_tokens": a.max_new_tokens, "prompts": a.prompts, "sets": {}}
    t0 = time.perf_counter()
    answers: dict[str, list] = {}
    for name in a.sets:
        res["sets"][name] = answers_report(
            load_eval_prompts(name, a.prompts), lambda h: build_prompt_ids(target.tokenizer, h),
            lambda ids: target_generate(target, ids, a.max_new_tokens, eos_token_id=eos)[0],
            lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True), eos,
            a.both_turns and name == "mt_bench", answers.setdefault(name, []))
        r = res["sets"][name]
        print(f"{name}: {r['sequences']} answers, {r['supervised_tokens']} tokens, copyable {r['copyable']:.3f}, "
              + ", ".join(f"{k} {v['copyable']}" for k, v in r["by_position"].items()), flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(a.out, res)
    if a.answers_out:
        a.answers_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(a.answers_out, {k: res[k] for k in ("command", "commit", "target", "device", "max_new_tokens")}
                          | {"eos": list(eos) if eos else None, "sets": answers})
    return res


if __name__ == "__main__":
    main()
