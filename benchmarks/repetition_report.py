"""How much of a prepared split's supervised text repeats what came before it in the same sequence.

    python benchmarks/repetition_report.py RUN_DIR [--n 4] [--out REPORT.json]
    python benchmarks/repetition_report.py RUN_DIR --answers RECIPE.yaml   # + the regeneration shards' answers

A suspect for drafters whose deep drafts score well in training but are not accepted on real prompts
(issue 20): greedy regeneration by a small target falls into loops, and a loop's continuation can be
copied from the context at every depth, so an evaluation on such text rewards copying. This report
measures it on ``RUN_DIR/data/{train,eval}.safetensors`` (``peagle-train prepare``'s output).

A supervised token ``t[i]`` is **copyable** when the ``n`` tokens before it, ``t[i-n:i]``, occurred
earlier in the same sequence and were followed there by ``t[i]`` (the rule of n-gram / prompt-lookup
drafting: a lookup in the context predicts it; ``data_prep.loops.copyable_flags``, the rule that
``data.loop_tail: unsupervise`` applies). Per split the report gives the sequences, supervised
tokens, the copyable fraction overall and by the token's position in its answer (tokens since its
supervised span began: ``[0, 64)``, ``[64, 128)``, ``[128, 256)``, ``[256, inf)``; a real-prompt evaluation
of 64 new tokens sees the first bucket only), and ``looping_tail``: the fraction of sequences whose last
``TAIL`` (64, ``data_prep.loops.MIN_TAIL``) supervised tokens are at least 90 % copyable
(``TAIL_FRACTION``).

``--answers RECIPE``: also the split ``regenerated_answers``, every assistant answer of the regeneration
shards (``RUN_DIR/data/regen/*.json``, e.g. carried back from a machine before tokenisation), each answer
alone as one supervised sequence, tokenised by the recipe's target tokenizer: what regeneration wrote,
before the chat template, ``data.loop_tail`` and ``data.max_length`` apply (the context of a copy is the
answer itself, not its prompt, so the share is a lower bound).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_prep.loops import LOOKUP_N, MIN_TAIL, TAIL_FRACTION, copyable_flags  # noqa: E402  (data.loop_tail's rule)

BUCKETS = (0, 64, 128, 256)  # bucket starts: positions in the answer
TAIL = MIN_TAIL


def bucket_name(k: int) -> str:
    """The label of position bucket ``k`` (an index into ``BUCKETS``), e.g. ``"[64, 128)"``, ``"[256, inf)"``."""
    hi = BUCKETS[k + 1] if k + 1 < len(BUCKETS) else None
    return f"[{BUCKETS[k]}, {hi if hi is not None else 'inf'})"


def split_report(split: dict, n: int = LOOKUP_N) -> dict:
    """The report of one split ``{"input_ids": [[...]], "loss_mask": [[...]]}`` (see the module docstring)."""
    total = [0] * len(BUCKETS)
    hits = [0] * len(BUCKETS)
    tails = 0
    for ids, mask in zip(split["input_ids"], split["loss_mask"]):
        flags = copyable_flags(ids, mask, n)
        for pos, c in flags:
            k = max(b for b in range(len(BUCKETS)) if pos >= BUCKETS[b])
            total[k] += 1
            hits[k] += c
        tail = flags[-TAIL:]
        tails += len(tail) == TAIL and sum(c for _, c in tail) >= TAIL_FRACTION * TAIL
    seqs = len(split["input_ids"])
    return {"sequences": seqs, "supervised_tokens": sum(total),
            "copyable": round(sum(hits) / max(1, sum(total)), 4),
            "by_position": {bucket_name(k): {"tokens": total[k], "copyable": round(hits[k] / total[k], 4) if total[k] else None}
                            for k in range(len(BUCKETS))},
            "looping_tail": round(tails / max(1, seqs), 4)}


def shard_split(regen_dir: Path, tokenize) -> dict:
    """Every assistant answer of the regeneration shards ``regen_dir/*.json`` (``{"conversations": [...]}``, as
    ``peagle-train prepare`` writes them) as one sequence, all of it supervised: ``{"input_ids", "loss_mask"}``
    (lists of token-id lists and of 1s) for :func:`split_report`. ``tokenize``: ``text -> list[int]`` (no special
    tokens added).

    Raises:
        ValueError: a file that is not a regeneration shard (not JSON, or no ``conversations`` list), naming it.
    """
    ids = []
    for f in sorted(regen_dir.glob("*.json")):
        try:
            convs = json.loads(f.read_text())["conversations"]
            answers = [m["content"] for conv in convs for m in conv if m["role"] == "assistant"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{f}: not a regeneration shard ({type(e).__name__}: {e}); give the shards "
                             "peagle-train prepare wrote in data/regen/") from None
        ids += [tokenize(a) for a in answers]
    return {"input_ids": ids, "loss_mask": [[1] * len(x) for x in ids]}


def recipe_tokenizer(recipe: str):
    """``text -> ids`` (token ids, no special tokens added) with the target tokenizer of ``recipe``, read by the
    rule every stage uses (``materialise_target``, ``tokenizer_source``).

    Raises:
        ConfigError / TargetLoadError: the recipe or its target cannot be read (their messages name the key).
    """
    from transformers import AutoTokenizer

    from peagle_train.features.target import materialise_target, tokenizer_source
    from peagle_train.recipe import load_config

    target = load_config(recipe, []).target
    tok = AutoTokenizer.from_pretrained(tokenizer_source(target, materialise_target(target)))
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--n", type=int, default=LOOKUP_N, help=f"context tokens of the lookup (default {LOOKUP_N})")
    p.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    p.add_argument("--answers", default=None, metavar="RECIPE",
                   help="also the regeneration shards' answers (data/regen/*.json), tokenised by this recipe's target")
    a = p.parse_args(argv)
    from peagle_train.features.tokenized import load_tokenized

    res = {"run_dir": str(a.run_dir), "n": a.n, "splits": {}}
    for name in ("train", "eval"):
        f = a.run_dir / "data" / f"{name}.safetensors"
        if f.is_file():
            res["splits"][name] = split_report(load_tokenized(f), a.n)
    if a.answers:
        regen = a.run_dir / "data" / "regen"
        if not list(regen.glob("*.json")):
            sys.exit(f"repetition_report: --answers: {regen} holds no regeneration shard (*.json)")
        try:
            res["splits"]["regenerated_answers"] = split_report(shard_split(regen, recipe_tokenizer(a.answers)), a.n)
        except ValueError as e:  # a file that is not a shard; a recipe that does not load (ConfigError)
            sys.exit(f"repetition_report: --answers: {e}")
    if not res["splits"]:
        sys.exit(f"repetition_report: {a.run_dir / 'data'} holds no train.safetensors or eval.safetensors: "
                 "give the output_dir of a prepared run (or --answers RECIPE for its regeneration shards)")
    meta = a.run_dir / "data" / "meta.json"
    if meta.is_file():  # the regeneration's unfinished count, beside the repetition
        for name, s in json.loads(meta.read_text()).get("splits", {}).items():
            regen = s.get("regeneration") or {}
            if name in res["splits"] and regen:
                res["splits"][name]["unfinished_responses"] = regen.get("unfinished_responses")
                res["splits"][name]["max_new_tokens"] = (regen.get("sampling") or {}).get("max_new_tokens")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))
    heads = [bucket_name(k) for k in range(len(BUCKETS))]
    print(f"| split | sequences | supervised tokens | copyable (n = {a.n}) | " + " | ".join(heads) + " | looping tail |")
    print("|---" * (5 + len(heads)) + "|")
    for name, r in res["splits"].items():
        cells = [f"{r['by_position'][h]['copyable']:.3f}" if r["by_position"][h]["copyable"] is not None else "-"
                 for h in heads]
        print(f"| {name} | {r['sequences']} | {r['supervised_tokens']:,} | {r['copyable']:.3f} | " + " | ".join(cells)
              + f" | {r['looping_tail']:.3f} |")
    return res


if __name__ == "__main__":
    main()
