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


def main(argv: list[str] | None = None) -> bool:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("eager", type=Path)
    p.add_argument("compiled", type=Path)
    p.add_argument("--out", type=Path, default=None, help="also write {use_compiled, reason, ...figures} here")
    a = p.parse_args(argv)
    use, reason, figures = choose(_load(a.eager), _load(a.compiled))
    print("true" if use else "false")
    print(reason)
    if a.out is not None:
        a.out.write_text(json.dumps({"use_compiled": use, "reason": reason, **figures}, indent=1))
    return use


if __name__ == "__main__":
    main()
