"""Whether the evaluation should run the target's forward compiled (``eval.compile_target``), from two small
evaluations of the same drafter on the same prompts, one eager and one compiled (``quality_experiment.sh eval``
with ``EVAL_COMPILE=auto`` makes them: its one-process drafting-cost pass, run both ways).

    python benchmarks/compile_choice.py EAGER_EVAL.json COMPILED_EVAL.json [--out CHOICE.json]

Prints ``true`` or ``false`` on the first line and the reason on the second; ``--out`` writes both with the
figures compared. ``true`` only when all of these hold:

* the compiled run's forward really was compiled (``target_runner`` is ``static+cuda-graphs``, or
  ``static+compiled`` where inductor skipped the CUDA graphs: no fallback to eager);
* both runs passed the lossless check, and every set and K has the same rounds and acceptance length (the
  compiled forward decodes the same tokens);
* the compiled run decodes faster: its seconds over all sets and K (target alone included) are below the
  eager run's.

Raises SystemExit naming the file when a report is missing or is not an ``eval.json``.
Stdlib only: it runs on the GPU machine before anything is installed there.

From a decode profile instead (``benchmarks/decode_profile.py``, ``quality_experiment.sh decode-profile``; about a
minute, no evaluation)::

    python benchmarks/compile_choice.py --profile decode_profile.json [--out CHOICE.json]

prints the ``eval.compile_target`` value of the fastest kind it timed (:func:`choose_from_profile`):
``true`` (CUDA graphs), ``inductor`` (compiled, no CUDA graphs) or ``false`` (eager), and why, over every
attention implementation the profile timed (``decode_profile.py --attn``), then a third line ``attn=NAME``: the
``target.attn_implementation`` the evaluation should load the target with: the one the fastest entry was timed
with, the recipe's own included (so the evaluation runs what was timed), empty (``attn=``) only for a profile made
before ``--attn``, which does not record it. ``--out`` also records
``attn_implementation`` (the fastest entry's, None where the profile does not say) and ``attn_override``. The
profile does not decode prompts, so the rounds are not compared here; the evaluation's own lossless check still
holds each run to the target's tokens (eager and SDPA attention compute the same scores: the same greedy tokens,
tests/unit/test_speculative.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"compile_choice: {path}: {e}")
    if "datasets" not in d or "lossless" not in d:
        sys.exit(f"compile_choice: {path}: not a peagle-train eval.json (no datasets / lossless)")
    return d


def _seconds(d: dict) -> float:
    """Decoding seconds of a report: the target alone and every K, over all sets."""
    return sum(ds["target_alone"]["seconds"] + sum(r["seconds"] for r in ds["by_K"]) for ds in d["datasets"].values())


def choose(eager: dict, compiled: dict) -> tuple[bool, str, dict]:
    """``(use_compiled, reason, figures)`` for two ``eval.json`` dicts (see the module docstring).

    ``figures``: ``eager_s`` / ``compiled_s`` (decoding seconds), ``speedup`` (eager / compiled),
    ``target_runner``, ``fallback`` and ``cudagraph_skips`` (inductor's reasons for running without CUDA
    graphs) of the compiled run."""
    figures = {"eager_s": round(_seconds(eager), 3), "compiled_s": round(_seconds(compiled), 3),
               "target_runner": compiled.get("target_runner"), "fallback": compiled.get("target_runner_fallback"),
               "cudagraph_skips": compiled.get("target_runner_cudagraph_skips")}
    figures["speedup"] = round(figures["eager_s"] / figures["compiled_s"], 3) if figures["compiled_s"] > 0 else None
    if compiled.get("target_runner") not in ("static+cuda-graphs", "static+compiled"):
        return False, (f"the compiled run's target forward was {compiled.get('target_runner')!r}"
                       + (f" ({figures['fallback']})" if figures["fallback"] else "")), figures
    if not (eager["lossless"].get("passed") and compiled["lossless"].get("passed")):
        return False, "a run failed the lossless check", figures
    if set(eager["datasets"]) != set(compiled["datasets"]):
        return False, "the two runs evaluated other sets", figures
    for name, ds in eager["datasets"].items():
        other = {r["K"]: r for r in compiled["datasets"][name]["by_K"]}
        for r in ds["by_K"]:
            o = other.get(r["K"])
            if o is None or (o["rounds"], o["acceptance_length"]) != (r["rounds"], r["acceptance_length"]):
                return False, f"{name} K={r['K']}: the compiled run decoded other rounds", figures
    if figures["compiled_s"] >= figures["eager_s"]:
        return False, f"not faster: {figures['compiled_s']} s compiled against {figures['eager_s']} s eager", figures
    return True, (f"same rounds and acceptance, {figures['speedup']}x faster "
                  f"({figures['compiled_s']} s against {figures['eager_s']} s)"), figures


#: the decode profile's kinds that are ``eval.compile_target`` settings (false: the eager ``dynamic`` kind the
#: evaluation then runs), each with the runner kinds that show the forward really ran that way (a compiled kind that
#: fell back to eager does not count)
PROFILE_KINDS = {"dynamic": ("false", ("dynamic",)), "inductor": ("inductor", ("static+inductor",)),
                 "compiled": ("true", ("static+cuda-graphs", "static+compiled"))}


def choose_from_profile(profile: dict) -> tuple[str, str, dict, dict]:
    """``(eval.compile_target value, reason, figures, attention)`` from a ``decode_profile.py`` JSON: of its
    entries of kinds ``dynamic`` (eager), ``inductor`` and ``compiled`` that ran as named (``runner``, no
    ``fallback``), each with the recipe's own attention (``KIND``) or another (``KIND@ATTN``), the one with the
    least milliseconds per call summed over the profiled query lengths (medians). ``figures``: each entry's sum,
    runner, fallback and ``attn`` (None in profiles made before ``--attn``). ``attention``: ``entry`` (the fastest
    entry's key), ``attn_implementation`` (its ``attn``) and ``attn_override`` (the ``target.attn_implementation``
    the evaluation loads the target with: the entry's recorded ``attn`` whenever the profile records one, the
    recipe's own included, so the evaluation runs what was timed whatever the recipe's default resolves to; None in
    profiles made before ``--attn``). None that ran as named: ``false`` (eager), all three None. Raises SystemExit when ``profile`` has no ``kinds``."""
    kinds = profile.get("kinds")
    if not isinstance(kinds, dict):
        sys.exit("compile_choice: the profile has no 'kinds' (a benchmarks/decode_profile.py JSON?)")
    figures, ok = {}, {}
    for key, row in kinds.items():
        kind, _, other = key.partition("@")
        if kind not in PROFILE_KINDS or not row:
            continue
        ms = round(sum(r["median_ms"] for r in row["per_length"].values()), 3)
        figures[key] = {"ms_per_call_summed": ms, "runner": row.get("runner"), "fallback": row.get("fallback"),
                        "attn": row.get("attn") or other or None}
        if row.get("runner") in PROFILE_KINDS[kind][1] and not row.get("fallback"):
            ok[key] = ms
    if not ok:
        return "false", "no kind of the profile ran as named: eager", figures, dict.fromkeys(
            ("entry", "attn_implementation", "attn_override"))

    def label(key):  # the kind, and its attention where the profile names it
        attn = figures[key]["attn"]
        return key.partition("@")[0] + (f" ({attn} attention)" if attn else "")

    best = min(ok, key=ok.get)
    others = ", ".join(f"{label(k)} {v} ms" for k, v in ok.items() if k != best)
    attention = {"entry": best, "attn_implementation": figures[best]["attn"],
                 "attn_override": figures[best]["attn"]}
    return PROFILE_KINDS[best.partition("@")[0]][0], f"{label(best)} {ok[best]} ms a call summed over the lengths" + (
        f" (against {others})" if others else ""), figures, attention


def main(argv: list[str] | None = None) -> bool | str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eager", type=Path, nargs="?")
    p.add_argument("compiled", type=Path, nargs="?")
    p.add_argument("--profile", type=Path, default=None, help="choose from a decode_profile.py JSON instead")
    p.add_argument("--out", type=Path, default=None, help="also write {use_compiled, reason, ...figures} here")
    a = p.parse_args(argv)
    if a.profile is not None:
        try:
            prof = json.loads(a.profile.read_text())
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"compile_choice: {a.profile}: {e}")
        value, reason, figures, attention = choose_from_profile(prof)
        print(value)
        print(reason)
        print(f"attn={attention['attn_override'] or ''}")  # quality_experiment.sh eval: an override where set
        if a.out is not None:
            a.out.write_text(json.dumps({"compile_target": value, "reason": reason, **attention, "kinds": figures},
                                        indent=1))
        return value
    if a.eager is None or a.compiled is None:
        p.error("give EAGER_EVAL.json COMPILED_EVAL.json, or --profile decode_profile.json")
    use, reason, figures = choose(_load(a.eager), _load(a.compiled))
    print("true" if use else "false")
    print(reason)
    if a.out is not None:
        a.out.write_text(json.dumps({"use_compiled": use, "reason": reason, **figures}, indent=1))
    return use


if __name__ == "__main__":
    main()
