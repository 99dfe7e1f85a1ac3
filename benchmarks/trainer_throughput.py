"""Steady-state speed of real ``peagle-train train`` runs, read from what the trainer wrote.

For each run folder (an ``output_dir`` after ``peagle-train train``) this reads
``train_metrics.json`` (the step history the trainer records: per optimizer step its
``elapsed_s`` since training started, ``tokens`` and ``positions`` of the step, and whether an
in-training evaluation ran after it) and ``logs/profile.json`` when ``train.profile_steps`` was set,
and reports:

* ``step_ms``: the median wall time between consecutive steps after ``--skip`` warm-up steps,
  leaving out the steps followed by an in-training evaluation (their gap includes it) -- the
  steady-state step as a user's run pays it, logging and the progress bar included;
* ``tokens_per_s``: target tokens trained per second over the same steps (sum of the steps'
  tokens / sum of their gaps), and ``tokens_per_s_overall``: over the whole run (evaluations,
  compilation and warm-up included: tokens of all steps / ``elapsed_s`` of the last);
* ``eval_s``: the time of each in-training evaluation (gap of its step minus the median step);
* ``first_steps_s``: the time to the end of step ``--skip`` (target load excluded: the clock starts
  at ``fit()``);
* the run's recipe keys that decide speed (micro-batch, features, compile, target dtype, K);
* ``finished``: false when the run stopped before its end (no ``train_metrics.json``): the steps are
  then read from ``logs/steps.jsonl``, which the trainer appends to after every step;
* ``peak``: the memory planner's predicted peak against the measured one, from the last trained
  train-stage record of ``logs/stages.jsonl`` (:func:`peak_vs_predicted`; absent without one).

Usage::

    python benchmarks/trainer_throughput.py RUN_DIR [RUN_DIR ...] --names base bf16 --out summary.json
    # ZeRO-2 / FSDP2 against the plain run (issue 19): tokens/s ratio and how the losses follow
    python benchmarks/trainer_throughput.py plain zero2 fsdp2 --reference plain --skip 5
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml


def step_gaps(history: list[dict]) -> list[tuple[int, float, int, bool]]:
    """``(step, seconds since the previous step's end, tokens, evaluated)`` per recorded step.

    The first step's gap is its ``elapsed_s`` (from the start of ``fit()``). ``evaluated``: an
    in-training evaluation ran after the step (its record holds ``eval_loss``); ``elapsed_s`` is
    taken before that evaluation, so its time falls in the *next* step's gap.

    Raises:
        ValueError: a record without ``elapsed_s`` (a run from before the trainer recorded it).
    """
    out, prev = [], 0.0
    for rec in history:
        if "elapsed_s" not in rec:
            raise ValueError(f"step {rec.get('step')}: no elapsed_s in the history (re-run with a current trainer)")
        out.append((rec["step"], rec["elapsed_s"] - prev, int(rec.get("tokens", 0)), "eval_loss" in rec))
        prev = rec["elapsed_s"]
    return out


def read_history(run_dir: Path) -> tuple[list[dict], bool, Path]:
    """``(history, partial, file)``: the step records of ``train_metrics.json``, or of ``logs/steps.jsonl``
    for a run stopped before its end (``partial``).

    Raises:
        FileNotFoundError: neither file (names the folder).
    """
    metrics_file = run_dir / "train_metrics.json"
    if metrics_file.is_file():
        return json.loads(metrics_file.read_text())["history"], False, metrics_file
    metrics_file = run_dir / "logs" / "steps.jsonl"  # appended by the trainer after every step
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{run_dir / 'train_metrics.json'}: not found (nor logs/steps.jsonl); run "
                                "`peagle-train train` on this folder first")
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()], True, metrics_file


def against_reference(ref: list[dict], other: list[dict]) -> dict:
    """How a run's losses follow a reference run's, step by step (a distributed strategy against the
    plain run on the same recipe and data: issue 19's "losses equal within bf16 noise").

    Args:
        ref, other: step histories (:func:`read_history`), records with ``step`` and ``loss``.

    Returns:
        ``{"steps_compared", "loss_max_abs_diff", "loss_max_rel_diff", "loss_mean_rel_diff", "last_step_rel_diff"}``
        over the steps both recorded (relative to the reference's loss).

    Raises:
        ValueError: no step in common.
    """
    a = {h["step"]: h["loss"] for h in ref}
    pairs = [(a[h["step"]], h["loss"]) for h in other if h["step"] in a]
    if not pairs:
        raise ValueError("no optimizer step recorded by both runs")
    rel = [abs(o - r) / max(abs(r), 1e-12) for r, o in pairs]
    return {"steps_compared": len(pairs), "loss_max_abs_diff": max(abs(o - r) for r, o in pairs),
            "loss_max_rel_diff": max(rel), "loss_mean_rel_diff": sum(rel) / len(rel), "last_step_rel_diff": rel[-1]}


def peak_vs_predicted(run_dir: Path) -> dict | None:
    """The planner's predicted peak of the last launch that trained against the peak it measured, from the
    last ``train`` record of ``<run_dir>/logs/stages.jsonl`` that is not ``reused`` and holds
    ``predicted_peak_bytes`` (the trainer's prediction for the largest micro-batch it trained,
    ``peagle_train.stages.run_train``).

    Returns:
        ``{"predicted_bytes", "measured_bytes", "rel_error", "predicted_for"}``: ``rel_error`` =
        (predicted - measured) / measured (positive: the planner predicted more), None without a
        measurement (no CUDA); None when no such record exists.
    """
    f = run_dir / "logs" / "stages.jsonl"
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []
    recs = [r for r in recs if r["stage"] == "train" and not r["reused"] and r.get("predicted_peak_bytes")]
    if not recs:
        return None
    pred, meas = recs[-1]["predicted_peak_bytes"], recs[-1]["peak_gpu_bytes"]
    return {"predicted_bytes": pred, "measured_bytes": meas, "rel_error": (pred - meas) / meas if meas else None,
            "predicted_for": recs[-1].get("predicted_peak_for")}


def summarise(run_dir: Path, skip: int) -> dict:
    """The summary of one run folder (module docstring).

    Raises:
        FileNotFoundError: no ``train_metrics.json`` (the run did not finish; names the file).
        ValueError: fewer than ``skip + 2`` recorded steps.
    """
    hist, partial, metrics_file = read_history(run_dir)
    gaps = step_gaps(hist)
    if len(gaps) < skip + 2:
        raise ValueError(f"{metrics_file}: {len(gaps)} steps recorded, need more than --skip {skip} + 1")
    after_eval = {s + 1 for s, _, _, ev in gaps if ev}  # a step whose gap holds the previous step's evaluation
    steady = [(s, g, t) for s, g, t, _ in gaps[skip:] if s not in after_eval]
    med = statistics.median(g for _, g, _ in steady)
    cfg_file = run_dir / "resolved_config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.is_file() else {}
    tc, target = cfg.get("train", {}), cfg.get("target", {})
    out = {
        "run_dir": str(run_dir), "finished": not partial, "steps": len(gaps), "skip": skip,
        "steady_steps": len(steady),
        "step_ms": round(1e3 * med, 2),
        "step_ms_p10_p90": [round(1e3 * q, 2) for q in _quantiles([g for _, g, _ in steady], (0.1, 0.9))],
        "tokens_per_step": round(statistics.mean(t for _, _, t in steady), 1),
        "tokens_per_s": round(sum(t for _, _, t in steady) / sum(g for _, g, _ in steady), 1),
        "tokens_per_s_overall": round(sum(t for _, _, t, _ in gaps) / hist[-1]["elapsed_s"], 1),
        "eval_s": [round(gaps[i + 1][1] - med, 2) for i, (_, _, _, ev) in enumerate(gaps[:-1]) if ev],
        "first_steps_s": round(hist[skip - 1]["elapsed_s"], 2) if skip else 0.0,
        "recipe": {"micro_batch_size": tc.get("micro_batch_size"), "grad_accum": tc.get("grad_accum"),
                   "features": tc.get("features"), "compile": tc.get("compile"), "K": tc.get("K"),
                   "mixed_precision": tc.get("mixed_precision"), "target_dtype": target.get("dtype"),
                   "random_weights": target.get("random_init_from_config") is not None},
        "peak_mem_gb": hist[-1].get("peak_mem_gb"),
    }
    peak = peak_vs_predicted(run_dir)
    if peak is not None:
        out["peak"] = peak
    prof = run_dir / "logs" / "profile.json"
    if prof.is_file():
        out["profile"] = json.loads(prof.read_text())
    return out


def _quantiles(xs: list[float], qs: tuple[float, ...]) -> list[float]:
    s = sorted(xs)
    return [s[min(len(s) - 1, int(q * len(s)))] for q in qs]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (output_dir) after `peagle-train train`")
    ap.add_argument("--names", nargs="*", default=None, help="a name per run (default: the folder names)")
    ap.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the steady state")
    ap.add_argument("--out", default=None, help="write the summaries here (JSON)")
    ap.add_argument("--reference", default=None, metavar="NAME", help="a run's name: every other run gets "
                    "vs_reference (its tokens/s over the reference's, and how its losses follow the reference's)")
    args = ap.parse_args(argv)
    names = args.names or [Path(r).name for r in args.runs]
    rows = []
    for name, run in zip(names, args.runs):
        try:
            rows.append({"name": name, **summarise(Path(run), args.skip)})
        except (OSError, ValueError) as e:
            rows.append({"name": name, "run_dir": run, "error": str(e)})
    ref = next((r for r in rows if r["name"] == args.reference and "error" not in r), None)
    if args.reference is not None and ref is None:
        raise SystemExit(f"--reference {args.reference}: no summarised run of that name among {names}")
    for r in rows:
        if ref is not None and r is not ref and "error" not in r:
            r["vs_reference"] = {"reference": ref["name"], "tokens_per_s_ratio": r["tokens_per_s"] / ref["tokens_per_s"],
                                 **against_reference(read_history(Path(ref["run_dir"]))[0],
                                                     read_history(Path(r["run_dir"]))[0])}
    for r in rows:
        if "error" in r:
            print(f"{r['name']:>16}: {r['error']}")
        else:
            print(f"{r['name']:>16}: step {r['step_ms']:8.1f} ms  {r['tokens_per_s']:10.0f} tok/s  "
                  f"({r['tokens_per_step']:.0f} tok/step, {r['steady_steps']} steps; overall {r['tokens_per_s_overall']:.0f} "
                  f"tok/s; evals {r['eval_s']} s)")
            if r.get("peak", {}).get("rel_error") is not None:
                p = r["peak"]
                print(f"{'':>16}  peak {p['measured_bytes'] / 2**30:.2f} GiB measured, "
                      f"{p['predicted_bytes'] / 2**30:.2f} GiB predicted ({100 * p['rel_error']:+.1f} %)")
            if "vs_reference" in r:
                v = r["vs_reference"]
                print(f"{'':>16}  vs {v['reference']}: {v['tokens_per_s_ratio']:.3f}x tokens/s, loss max rel. diff "
                      f"{v['loss_max_rel_diff']:.2e} over {v['steps_compared']} steps")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
