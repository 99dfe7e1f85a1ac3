"""Summary of the quality experiment's ablation (``benchmarks/quality_experiment.sh ablate``).

Reads one folder per P-EAGLE variant under ROOT (the script's ``$WORK/ablate``)::

    ROOT/<variant>/train_metrics.json   written by ``peagle-train train`` (final metrics + history)
    ROOT/<variant>/variant.txt          "minutes=M overrides=a=b,c=d" (the script's record)
    ROOT/<variant>.err                  the run's stderr (quoted when train_metrics.json is missing)

and writes ``ablation.json`` (one row per variant) and ``ablation.md`` next to it, and prints the
Markdown. Each row holds the final acceptance lengths at the served K = min(7, trained K), the
optimizer steps made in the variant's minutes, the per-depth eval accuracy, and the eval curve
(``eval_walk_al`` at the served K at every eval step). The curves matter as much as the final
numbers: variants trained for the same minutes make different numbers of steps (a larger K or COD
r means more grid positions per step; a cold compile cache costs steps too), so the Markdown has
a second table of AL at the eval steps every variant reached.

The acceptance lengths are the trainer's simulated ones (``peagle_train.metrics``): ``walk_al``
walks the eval split the way the reference decoding loop does, ``walk_al_heldout`` the held-out
prompts; ``sim_al`` is the position-averaged estimate. No decoding loop runs in the ablation.

Usage::

    python benchmarks/ablation_report.py ROOT OUT_JSON [--minutes M] [--per-gpu P]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _at(d: dict | None, k: int) -> float | None:
    """``d[k]`` for a per-K dict with str or int keys (JSON round trips turn ints into str)."""
    if not d:
        return None
    v = d.get(str(k), d.get(k))
    return float(v) if v is not None else None


def variant_row(folder: Path) -> dict:
    """One ablation row from a variant folder.

    Args:
        folder: ``ROOT/<variant>``; see the module docstring for the files read.

    Returns:
        ``{"variant", "error"}`` when ``train_metrics.json`` is missing (the tail of the run's
        stderr, or a sentence saying nothing was logged); otherwise ``variant``, ``settings``,
        ``K``, ``al_at_K`` (= min(7, K)), ``steps``, ``train_s``, ``steps_per_s``, ``walk_al``,
        ``walk_al_heldout``, ``sim_al`` (at ``al_at_K``), ``eval_loss``, ``eval_acc`` (per depth,
        final) and ``eval_curve`` (``[{"step", "elapsed_s", "walk_al"}]`` at ``al_at_K``).

    Raises:
        ValueError: ``train_metrics.json`` lacks ``K``, ``steps``, ``train_seconds`` or
            ``final``; the message names the file.
    """
    f = folder / "train_metrics.json"
    if not f.exists():
        err_file = folder.parent / f"{folder.name}.err"
        err = err_file.read_text().strip()[-400:] if err_file.exists() else ""
        return {"variant": folder.name, "error": err or "no train_metrics.json and no stderr"}
    m = json.loads(f.read_text())
    missing = [k for k in ("K", "steps", "train_seconds", "final") if k not in m]
    if missing:
        raise ValueError(f"{f}: missing {missing}; is this a peagle-train train_metrics.json?")
    k = min(7, int(m["K"]))  # served K <= trained K
    fin = m["final"]
    spec = (folder / "variant.txt").read_text().strip() if (folder / "variant.txt").exists() else ""
    curve = [{"step": h["step"], "elapsed_s": round(h["elapsed_s"], 1) if h.get("elapsed_s") is not None else None,
              "walk_al": _at(h.get("eval_walk_al"), k)}
             for h in m.get("history", []) if "eval_walk_al" in h]
    return {"variant": folder.name, "settings": spec, "K": m["K"], "al_at_K": k, "steps": m["steps"],
            "train_s": round(m["train_seconds"], 1), "steps_per_s": round(m["steps"] / m["train_seconds"], 2),
            "walk_al": _at(fin.get("eval_walk_al"), k), "walk_al_heldout": _at(fin.get("eval_walk_al_heldout"), k),
            "sim_al": _at(fin.get("eval_sim_al"), k), "eval_loss": fin.get("eval_loss"),
            "eval_acc": fin.get("eval_acc"), "eval_curve": curve}


def summarize(root: Path) -> list[dict]:
    """Rows of every variant folder under ``root``, sorted by name (see :func:`variant_row`).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no ablation folder (run quality_experiment.sh ablate first)")
    return [variant_row(d) for d in sorted(p for p in root.iterdir() if p.is_dir())]


def common_eval_steps(rows: list[dict]) -> list[int]:
    """Eval steps present in the curve of every finished row (ascending); ``[]`` if none."""
    done = [r for r in rows if "error" not in r]
    if not done:
        return []
    steps = set.intersection(*({c["step"] for c in r["eval_curve"] if c["walk_al"] is not None} for r in done))
    return sorted(steps)


def markdown(rows: list[dict]) -> str:
    """Two Markdown tables: final values in the variants' minutes, and AL at common eval steps."""
    f = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    out = ["| variant | settings | K (AL at) | steps | steps/s | walk AL heldout | walk AL | sim AL | "
           "eval acc depth 1..4 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | not finished: {r['error'][-120:]!r} | | | | | | | |")
            continue
        acc = " / ".join(f"{a:.2f}" for a in (r["eval_acc"] or [])[:4])
        out.append(f"| {r['variant']} | {r['settings']} | {r['K']} ({r['al_at_K']}) | {r['steps']} | "
                   f"{r['steps_per_s']} | {f(r['walk_al_heldout'])} | {f(r['walk_al'])} | {f(r['sim_al'])} | {acc} |")
    steps = common_eval_steps(rows)
    if steps:
        out += ["", "`eval_walk_al` at the eval steps every variant reached (equal optimizer steps):", "",
                "| variant | " + " | ".join(f"step {s}" for s in steps) + " |",
                "|---|" + "---|" * len(steps)]
        for r in rows:
            if "error" in r:
                continue
            by = {c["step"]: c["walk_al"] for c in r["eval_curve"]}
            out.append(f"| {r['variant']} | " + " | ".join(f(by[s]) for s in steps) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
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
