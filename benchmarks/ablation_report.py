"""Summary of the quality experiment's ablation (``benchmarks/quality_experiment.sh ablate``).

Reads one folder per P-EAGLE variant under ROOT (the script's ``$WORK/ablate``)::

    ROOT/<variant>/train_metrics.json   written by ``peagle-train train`` (final metrics + history)
    ROOT/<variant>/variant.txt          "minutes=M overrides=a=b,c=d" (the script's record)
    ROOT/<variant>.err                  the run's stderr (quoted when train_metrics.json is missing)

and writes ``ablation.json`` (one row per variant) and ``ablation.md`` next to it, and prints the
Markdown. Each row holds the final acceptance lengths at the served K = min(7, trained K), the
optimizer steps made in the variant's minutes, its step timing (median step, first step, time
lost to slow steps such as compiles), the per-depth eval accuracy, and the eval curve
(``eval_walk_al`` at the served K at every eval step, with the learning rate there). The curves
matter as much as the final numbers: variants trained for the same minutes make different numbers
of steps (a larger K or COD r means more grid positions per step; each new 1,024-bucketed grid
length compiles a graph, seconds each with a cold cache), so the Markdown has a second table of AL
at the eval steps that at least two variants reached.

The acceptance lengths are the trainer's simulated ones (``peagle_train.metrics``): ``walk_al``
walks the eval split the way the reference decoding loop does, ``walk_al_heldout`` the held-out
prompts; ``sim_al`` is the position-averaged estimate. No decoding loop runs in the ablation.

Usage::

    python benchmarks/ablation_report.py ROOT OUT_JSON [--minutes M] [--per-gpu P]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _at(d: dict | None, k: int) -> float | None:
    """``d[k]`` for a per-K dict with str or int keys (JSON round trips turn ints into str)."""
    if not d:
        return None
    v = d.get(str(k), d.get(k))
    return float(v) if v is not None else None


def _step_times(history: list[dict]) -> dict:
    """Timing of a run from its per-step ``elapsed_s`` (seconds since training started).

    Returns:
        ``first_step_s`` (elapsed at the first logged step: start-up and the first compile),
        ``median_step_ms`` (median interval between consecutive logged steps, per step) and
        ``slow_s`` (seconds in intervals longer than 3× that median, beyond the median: compiles of
        new grid buckets and the in-training evals); all None without timed steps.
    """
    t = [(h["step"], h["elapsed_s"]) for h in history if h.get("elapsed_s") is not None]
    if len(t) < 2:
        return {"first_step_s": round(t[0][1], 1) if t else None, "median_step_ms": None, "slow_s": None}
    gaps = [(b[1] - a[1], max(1, b[0] - a[0])) for a, b in zip(t, t[1:])]  # (seconds, steps) between logs
    med = statistics.median_high(dt / n for dt, n in gaps)
    slow = sum(dt - med * n for dt, n in gaps if dt > 3 * med * n)
    return {"first_step_s": round(t[0][1], 1), "median_step_ms": round(1000 * med, 1), "slow_s": round(slow, 1)}


def variant_row(folder: Path) -> dict:
    """One ablation row from a variant folder.

    Args:
        folder: ``ROOT/<variant>``; see the module docstring for the files read.

    Returns:
        ``{"variant", "error"}`` when ``train_metrics.json`` is missing (the tail of the run's
        stderr, or a sentence saying nothing was logged) or unreadable (the reason, naming the
        file), so one bad variant never hides the others' rows. Otherwise ``variant``, ``settings``,
        ``K``, ``al_at_K`` (= min(7, K)), ``steps``, ``train_s``, ``steps_per_s``, ``walk_al``,
        ``walk_al_heldout``, ``sim_al`` (at ``al_at_K``), ``eval_loss``, ``eval_acc`` (per depth,
        final), the timing of :func:`_step_times` and ``eval_curve``
        (``[{"step", "elapsed_s", "lr", "walk_al", "acc1_copyable", "acc1_fresh"}]``, ``walk_al`` at
        ``al_at_K``; ``lr`` is the learning rate logged at that step, which differs between variants at
        equal steps under ``train.schedule: time``; the first drafted position's accuracy on copyable and
        fresh labels of the eval split, None where the trainer did not log them), and the final
        ``acc1_copyable``, ``acc1_fresh`` and ``copyable_share``.
    """
    f = folder / "train_metrics.json"
    if not f.exists():
        err_file = folder.parent / f"{folder.name}.err"
        err = err_file.read_text().strip()[-400:] if err_file.exists() else ""
        return {"variant": folder.name, "error": err or "no train_metrics.json and no stderr"}
    try:
        m = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        return {"variant": folder.name, "error": f"{f}: not JSON ({e}); re-run the variant under another name"}
    missing = [k for k in ("K", "steps", "train_seconds", "final") if k not in m]
    if missing:
        return {"variant": folder.name,
                "error": f"{f}: missing {missing}; not a peagle-train train_metrics.json"}
    k = min(7, int(m["K"]))  # served K <= trained K
    fin = m["final"]
    spec = (folder / "variant.txt").read_text().strip() if (folder / "variant.txt").exists() else ""
    history = m.get("history", [])  # one record per step; an eval step's record also holds the eval
    curve = [{"step": h["step"], "elapsed_s": round(h["elapsed_s"], 1) if h.get("elapsed_s") is not None else None,
              "lr": h.get("lr"), "walk_al": _at(h.get("eval_walk_al"), k),
              "acc1_copyable": h.get("eval_acc1_copyable"), "acc1_fresh": h.get("eval_acc1_fresh")}
             for h in history if "eval_walk_al" in h]
    return {"variant": folder.name, "settings": spec, "K": m["K"], "al_at_K": k, "steps": m["steps"],
            "train_s": round(m["train_seconds"], 1), "steps_per_s": round(m["steps"] / m["train_seconds"], 2),
            **_step_times(history),
            "walk_al": _at(fin.get("eval_walk_al"), k), "walk_al_heldout": _at(fin.get("eval_walk_al_heldout"), k),
            "sim_al": _at(fin.get("eval_sim_al"), k), "eval_loss": fin.get("eval_loss"),
            "eval_acc": fin.get("eval_acc"), "acc1_copyable": fin.get("eval_acc1_copyable"),
            "acc1_fresh": fin.get("eval_acc1_fresh"), "copyable_share": fin.get("eval_copyable_share"),
            "eval_curve": curve}


def summarize(root: Path) -> list[dict]:
    """Rows of every variant folder under ``root``, sorted by name (see :func:`variant_row`).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no ablation folder (run quality_experiment.sh ablate first)")
    return [variant_row(d) for d in sorted(p for p in root.iterdir() if p.is_dir())]


def shared_eval_steps(rows: list[dict]) -> list[int]:
    """Eval steps with an AL in the curves of at least two finished rows (of the only one, if
    one finished), ascending; ``[]`` if none finished."""
    done = [r for r in rows if "error" not in r]
    count: dict[int, int] = {}
    for r in done:
        for c in r["eval_curve"]:
            if c["walk_al"] is not None:
                count[c["step"]] = count.get(c["step"], 0) + 1
    return sorted(s for s, n in count.items() if n >= min(2, len(done)))


def markdown(rows: list[dict]) -> str:
    """Two Markdown tables: final values in the variants' minutes, and AL at shared eval steps."""
    f = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    g = lambda x: "-" if x is None else f"{x}"  # noqa: E731
    out = ["| variant | settings | K (AL at) | steps | median step ms | first step s | slow s | walk AL heldout "
           "| walk AL | sim AL | eval acc depth 1..4 | acc@1 copyable / fresh |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | not finished: {r['error'][-120:]!r} |" + " |" * 10)
            continue
        acc = " / ".join("-" if a is None else f"{a:.2f}" for a in (r["eval_acc"] or [])[:4])
        out.append(f"| {r['variant']} | {r['settings']} | {r['K']} ({r['al_at_K']}) | {r['steps']} | "
                   f"{g(r['median_step_ms'])} | {g(r['first_step_s'])} | {g(r['slow_s'])} | "
                   f"{f(r['walk_al_heldout'])} | {f(r['walk_al'])} | {f(r['sim_al'])} | {acc} | "
                   f"{f(r.get('acc1_copyable'))} / {f(r.get('acc1_fresh'))} |")
    steps = shared_eval_steps(rows)
    if steps:
        out += ["", "`eval_walk_al` at the eval steps (learning rate there, in units of 1e-4). Under "
                "`train.schedule: time` a slower variant has a lower learning rate at the same step:", "",
                "| variant | " + " | ".join(f"step {s}" for s in steps) + " |",
                "|---|" + "---|" * len(steps)]
        for r in rows:
            if "error" in r:
                continue
            by = {c["step"]: c for c in r["eval_curve"]}
            cell = lambda c: "-" if c is None or c["walk_al"] is None else (  # noqa: E731
                f(c["walk_al"]) + (f" ({c['lr'] * 1e4:.1f})" if c.get("lr") is not None else ""))
            out.append(f"| {r['variant']} | " + " | ".join(cell(by.get(s)) for s in steps) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line: read every variant folder under ``root``, write ``out`` (JSON) and the Markdown
    table next to it (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path, help="folder with one sub-folder per variant")
    ap.add_argument("out", type=Path, help="ablation.json to write (ablation.md goes next to it)")
    ap.add_argument("--minutes", type=float, default=None, help="ABLATE_MINUTES of this call")
    ap.add_argument("--per-gpu", type=int, default=None, help="ABLATE_PER_GPU of this call")
    a = ap.parse_args(argv)
    rows = summarize(a.root)
    a.out.write_text(json.dumps({"minutes_this_call": a.minutes, "variants_per_gpu_this_call": a.per_gpu,
                                 "rows": rows}, indent=1))
    md = markdown(rows)
    a.out.with_suffix(".md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
