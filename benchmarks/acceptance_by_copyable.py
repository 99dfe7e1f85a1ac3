"""Acceptance on text a context lookup predicts against fresh text, from an eval's per-round records.

    python benchmarks/acceptance_by_copyable.py PARTS ANSWERS.json [--out REPORT.json]

``PARTS`` is the ``eval/parts/`` folder that ``peagle-train eval --eval-worker r/N`` writes (one
``worker-r-of-N.json`` per worker: per set and served ``K`` the accepted drafts of every verification round of
every sequence, in decoding order). ``ANSWERS.json`` holds the target's greedy answers to the same prompts with
their token ids (``benchmarks/eval_repetition.py --answers-out``, the same recipe, float32). The eval's output is
the target's greedy output (its lossless check), so round ``r`` of a sequence drafts from answer position
``p_r = 1 + sum_{j<r} (a_j + 1)`` on (the first new token is the target's own, from the prefill,
``peagle_train.decoding.speculative.speculative_generate``). Each round is classed by whether the token at
``p_r`` is *copyable*: its 4 tokens before occurred earlier in the prompt or answer, followed by it
(``data_prep.loops.copyable_flags``, the rule ``peagle-train eval`` reports as ``target_alone.copyable``). Per
set and ``K`` the report gives, for copyable and for fresh rounds, their count, the share accepting the first
draft (``acc1``) and the mean accepted drafts; and ``lookup_al``: the acceptance length prompt-lookup drafting
(:func:`lookup_draft`, no weights) would reach on the same answers with the same K.

What it asks (issue 20): does the drafter continue the loops a small target falls into, which a lookup
drafter would accept at every depth, or does it fail there as on fresh text? A sequence whose answer here has
another length than the eval's (decoding on another device can flip a near tie) is left out and counted.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_prep.loops import copyable_flags  # noqa: E402

PART = re.compile(r"worker-(\d+)-of-(\d+)\.json$")


def load_parts(parts: Path) -> list[tuple[int, int, dict]]:
    """``(rank, world, part)`` of every ``worker-r-of-N.json`` in ``parts``, by rank. Raises SystemExit naming the
    folder when it has none, or the file when one is not JSON or the worker counts disagree."""
    found = []
    for p in sorted(parts.glob("worker-*-of-*.json")):
        m = PART.search(p.name)
        try:
            found.append((int(m.group(1)), int(m.group(2)), json.loads(p.read_text())))
        except (json.JSONDecodeError, AttributeError) as e:
            sys.exit(f"acceptance_by_copyable: {p}: not an eval worker part ({e})")
    if not found:
        sys.exit(f"acceptance_by_copyable: {parts}: no worker-r-of-N.json (the eval/parts folder of --eval-worker runs)")
    worlds = {w for _, w, _ in found}
    if len(worlds) != 1 or sorted(r for r, _, _ in found) != list(range(worlds.pop())):
        sys.exit(f"acceptance_by_copyable: {parts}: parts of several worker counts or a missing rank: "
                 f"{sorted((r, w) for r, w, _ in found)}")
    return sorted(found, key=lambda x: x[0])


def round_starts(accepted: list[int]) -> list[int]:
    """Answer position each round drafts from: ``[1, 1 + a_0 + 1, ...]`` (position 0 is the prefill's token).

    Example: accepted ``[0, 2, 1]`` gives ``[1, 2, 5]``."""
    out, p = [], 1
    for a in accepted:
        out.append(p)
        p += a + 1
    return out


def classify(prompt_ids: list[int], answer_ids: list[int], eos: list[int] | None) -> list[bool]:
    """Copyable flag per answer position (EOS, when the answer ends with it, is not copyable)."""
    text = answer_ids[:-1] if eos and answer_ids and answer_ids[-1] in eos else answer_ids
    flags = [c for _, c in copyable_flags(list(prompt_ids) + list(text), [0] * len(prompt_ids) + [1] * len(text))]
    return flags + [False] * (len(answer_ids) - len(text))


def lookup_draft(context: list[int], K: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt-lookup (n-gram) drafting: for ``n`` from ``n_max`` down to ``n_min``, the most recent earlier
    occurrence of the last ``n`` tokens of ``context``; the up to ``K`` tokens that followed it there (none found:
    an empty draft). A drafter with no weights, the baseline a trained drafter has to beat on looping text.

    Example: context ``[1, 2, 3, 1, 2]``, K 2: ``[1, 2]`` occurred at 0, followed by ``[3, 1]``."""
    L = len(context)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = context[L - n:]
        for start in range(L - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + K]
    return []


def lookup_walk(prompt_ids: list[int], answer_ids: list[int], K: int) -> list[int]:
    """Accepted drafts per round when :func:`lookup_draft` drafts for the target's greedy ``answer_ids``: the rounds
    of the reference loop (the first answer token from the prefill, each round the longest prefix of the draft equal
    to the answer there, then the target's own token), as ``peagle-train eval`` counts them."""
    acc, p = [], 1
    while p < len(answer_ids):
        d = lookup_draft(list(prompt_ids) + list(answer_ids[:p]), K)
        a = 0
        while a < len(d) and p + a < len(answer_ids) and d[a] == answer_ids[p + a]:
            a += 1
        acc.append(a)
        p += a + 1
    return acc


def _empty() -> dict:
    return {"rounds": 0, "acc1": 0, "accepted": 0}


def acceptance_by_copyable(parts: list[tuple[int, int, dict]], answers: dict) -> dict:
    """Per set and served K: ``{"copyable": {...}, "fresh": {...}}`` with ``rounds``, ``acc1`` (share of rounds
    accepting draft 1) and ``mean_accepted``; plus ``sequences`` used and ``skipped`` (length mismatch).

    Sequences are matched by position: worker ``r`` of ``N`` decoded the prompts ``i % N == r`` of a set in
    order (or, claiming its prompts, those its part lists under ``prompts``, in that order), each prompt's turns in
    order (``peagle_train.eval.evaluate``), as ``answers`` lists them.
    Raises SystemExit naming the set when ``answers`` lacks it or a worker's sequence count does not match."""
    eos = answers.get("eos")
    out: dict = {}
    for name in dict.fromkeys(n for _, _, part in parts for n in part["datasets"]):  # every worker's sets, in order
        if name not in answers["sets"]:
            continue  # e.g. heldout: token prompts, not decoded by eval_repetition
        seqs = answers["sets"][name]
        by_prompt: dict[int, list[dict]] = {}
        for s in seqs:
            by_prompt.setdefault(s["prompt"], []).append(s)
        res: dict = {}
        used = skipped = 0
        for r, world, part in parts:
            if part.get("claim") is not None and name not in part["datasets"]:
                continue  # a claiming worker that stopped before this set: the others hold its prompts
            d = part["datasets"][name]
            taken = (part.get("prompts") or {}).get(name) or []  # claiming workers list theirs, in decoding order
            order = taken if part.get("claim") is not None else [pi for pi in sorted(by_prompt) if pi % world == r]
            mine = [s for pi in order for s in by_prompt.get(pi, [])]
            if len(mine) != d["sequences"]:
                sys.exit(f"acceptance_by_copyable: set {name}, worker {r}/{world}: {d['sequences']} sequences in the "
                         f"eval, {len(mine)} in the answers file: same recipe, prompts and both_turns?")
            for k, stats in d["per_k"].items():
                row = res.setdefault(k, {"copyable": _empty(), "fresh": _empty()})
                for seq, st in zip(mine, stats):
                    if len(seq["answer_ids"]) != st["new_tokens"]:
                        skipped += k == next(iter(d["per_k"]))
                        continue
                    used += k == next(iter(d["per_k"]))
                    flags = classify(seq["prompt_ids"], seq["answer_ids"], eos)
                    for p, a in zip(round_starts(st["accepted"]), st["accepted"]):
                        if p >= len(flags):
                            break  # the last round verified past the cap
                        c = row["copyable" if flags[p] else "fresh"]
                        c["rounds"] += 1
                        c["acc1"] += a >= 1
                        c["accepted"] += a
        for k, row in res.items():
            walks = [lookup_walk(sq["prompt_ids"], sq["answer_ids"], int(k)) for sq in seqs]
            rounds = sum(map(len, walks))
            row["lookup_al"] = round(sum(a + 1 for w in walks for a in w) / rounds, 4) if rounds else None
            for c in (row["copyable"], row["fresh"]):
                n = c.pop("rounds")
                acc1, acc = c.pop("acc1"), c.pop("accepted")
                c.update(rounds=n, acc1=round(acc1 / n, 4) if n else None,
                         mean_accepted=round(acc / n, 4) if n else None)
        out[name] = {"sequences": used, "skipped": skipped, "per_k": res}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", type=Path)
    ap.add_argument("answers", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        answers = json.loads(a.answers.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        sys.exit(f"acceptance_by_copyable: {a.answers}: {e} (write it with eval_repetition.py --answers-out)")
    res = {"command": "python benchmarks/acceptance_by_copyable.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "sets": acceptance_by_copyable(load_parts(a.parts), answers)}
    for name, s in res["sets"].items():
        for k, row in s["per_k"].items():
            print(f"{name} K={k}: copyable rounds {row['copyable']['rounds']} acc1 {row['copyable']['acc1']} "
                  f"mean accepted {row['copyable']['mean_accepted']}; fresh rounds {row['fresh']['rounds']} "
                  f"acc1 {row['fresh']['acc1']} mean accepted {row['fresh']['mean_accepted']}; lookup AL {row['lookup_al']} "
                  f"({s['sequences']} sequences, {s['skipped']} skipped)")
    if a.out:
        from peagle_train.core.atomic import write_json_atomic

        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(a.out, res)
    return res


if __name__ == "__main__":
    main()
