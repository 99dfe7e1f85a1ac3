"""Learning curves of drafters side by side: acceptance length against GPU-minutes and against tokens seen.

    python benchmarks/plot_curves.py OUT.png CURVE.json [CURVE.json ...] [--label NAME ...]

Each ``CURVE.json`` is what ``benchmarks/run_curve.py`` writes for one run (its ``curve`` rows: ``step``,
``gpu_minutes``, ``tokens_seen``, ``walk_al``, ``sim_al`` at the file's ``K``). The PNG has two panels:
``walk_al`` (the reference loop's acceptance length replayed on the eval split, ``eval_walk_al``; the figure
that matched the decoding loop on held-out prompts, docs/results.md) against the training minutes of the run,
summed over its launches, and against the target tokens it trained on; ``sim_al`` as a dashed line of the
same colour. The label of a curve is ``--label`` (one per file, in order) or the file's name without
``-curve.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_curve(path: Path) -> dict:
    """The run_curve JSON at ``path``. Raises SystemExit naming the file when it is missing, not JSON, or has
    no ``curve`` rows with ``gpu_minutes``, ``tokens_seen`` and ``walk_al``."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        sys.exit(f"plot_curves: {path}: no such file; give the JSON benchmarks/run_curve.py wrote")
    except json.JSONDecodeError as e:
        sys.exit(f"plot_curves: {path}: not JSON ({e})")
    rows = data.get("curve") if isinstance(data, dict) else None
    if not rows or not all(isinstance(r, dict) and {"gpu_minutes", "tokens_seen", "walk_al"} <= r.keys() for r in rows):
        sys.exit(f"plot_curves: {path}: no curve rows with gpu_minutes, tokens_seen and walk_al "
                 f"(a run_curve.py JSON of a run that evaluated at least once)")
    return data


def set_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The walk on each evaluation set of ``train.eval_walk_sets`` (run_curve's ``walk_al_<set>`` columns, e.g.
    ``walk_al_humaneval``; not ``walk_al_heldout``): ``{set: [(row index, AL), ...]}`` over the rows that have
    it, sets in name order. Example: rows ``[{"walk_al_humaneval": 1.2}, {}, {"walk_al_humaneval": 1.5}]`` give
    ``{"humaneval": [(0, 1.2), (2, 1.5)]}``."""
    names = sorted({k for r in rows for k in r if k.startswith("walk_al_") and k != "walk_al_heldout"})
    return {k.removeprefix("walk_al_"): [(i, r[k]) for i, r in enumerate(rows) if r.get(k) is not None]
            for k in names}


def plot_curves(curves: list[tuple[str, dict]], out_png: Path) -> Path:
    """Write ``out_png``: ``walk_al`` (solid, dots), ``sim_al`` (dashed) and, where the rows have it,
    ``walk_al_heldout`` (dotted, squares) and the ``walk_al_<set>`` of :func:`set_series` (dash-dot, triangles)
    of each ``(label, curve)`` against
    GPU-minutes (left) and millions of tokens seen (right). Returns ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for i, (label, data) in enumerate(curves):
        rows = data["curve"]
        colour = f"C{i}"
        for ax, x in zip(axes, ([r["gpu_minutes"] for r in rows], [r["tokens_seen"] / 1e6 for r in rows])):
            ax.plot(x, [r["walk_al"] for r in rows], "o-", color=colour, label=f"{label}: walk AL")
            sim = [(xi, r.get("sim_al")) for xi, r in zip(x, rows) if r.get("sim_al") is not None]
            if sim:
                ax.plot(*zip(*sim), "--", color=colour, alpha=0.6, label=f"{label}: simulated AL")
            held = [(xi, r.get("walk_al_heldout")) for xi, r in zip(x, rows) if r.get("walk_al_heldout") is not None]
            if held:
                ax.plot(*zip(*held), "s:", color=colour, alpha=0.8, markersize=3,
                        label=f"{label}: walk AL, held-out prompts")
            for j, (name, pts) in enumerate(set_series(rows).items()):  # train.eval_walk_sets
                ax.plot([x[i] for i, _ in pts], [v for _, v in pts], "^v<>D"[j % 5] + "-.", color=colour, alpha=0.8,
                        markersize=4, label=f"{label}: walk AL, {name}")
    k = curves[0][1].get("K", 7) if curves else 7
    axes[0].set_xlabel("GPU-minutes of training")
    axes[1].set_xlabel("target tokens seen (millions)")
    axes[0].set_ylabel(f"acceptance length, K = {k} (eval split)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("curves", type=Path, nargs="+", help="run_curve.py JSON files")
    p.add_argument("--label", action="append", default=None, help="one per curve, in order")
    a = p.parse_args(argv)
    if a.label is not None and len(a.label) != len(a.curves):
        sys.exit(f"plot_curves: {len(a.label)} --label for {len(a.curves)} curves: give one per curve or none")
    labels = a.label or [c.name.removesuffix(".json").removesuffix("-curve") for c in a.curves]
    out = plot_curves([(lab, load_curve(c)) for lab, c in zip(labels, a.curves)], a.out)
    print(f"plot_curves: {out}")
    return out


if __name__ == "__main__":
    main()
