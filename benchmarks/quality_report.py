"""Side-by-side tables of the quality experiment (benchmarks/quality_experiment.sh).

Reads the small result files the experiment copies to its results folder::

    <name>-eval.json           eval stage report (peagle_train.eval.evaluate.run_eval)
    <name>-train-metrics.json  train_metrics.json without the per-step history

for ``name`` in ``smollm2-135m-peagle-gpu`` and ``smollm2-135m-eagle3-gpu``, and writes
``comparison.md``, ``comparison.json`` and ``comparison.png`` next to them (also prints the Markdown):

* acceptance length at served K = 3, 5, 7 per dataset for both drafters and the ratio
  P-EAGLE / EAGLE-3 (the issue's target: >= 1.2 at K = 7);
* drafting ms per verification round for K = 1..7 and the ratio K=7 / K=1 (target for
  P-EAGLE: <= 1.3);
* end-to-end tokens/s of the batch-1 reference loop relative to the target alone;
* measured AL on the ``heldout`` set vs the loop-equivalent simulated AL logged at the end
  of training on the same prompts and horizon (``eval_walk_al_heldout``), and the relative
  gap (target: within 5 %); the position-averaged ``eval_sim_al`` is listed for reference.

Usage::

    python benchmarks/quality_report.py RESULTS_DIR [--eagle3 DIR] [--out DIR]

``--eagle3``: the EAGLE-3 arm's folder when it trained in a lease of its own (default: RESULTS_DIR, where the
P-EAGLE arm's files are); ``--out``: where the three files go (default: RESULTS_DIR).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

NAMES = {"peagle": "smollm2-135m-peagle-gpu", "eagle3": "smollm2-135m-eagle3-gpu"}


def _load(results: Path, name: str, kind: str) -> dict | None:
    path = results / f"{name}-{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _arm_dirs(results: Path, eagle3: Path | None) -> dict[str, Path]:
    """``{"peagle": results, "eagle3": eagle3 or results}``: the folder each drafter's files are read from."""
    return {"peagle": results, "eagle3": results if eagle3 is None else eagle3}


def _load_evals(results: Path, eagle3: Path | None = None) -> tuple[dict, list[str]]:
    """``({"peagle"|"eagle3": eval report or None}, datasets present)``; EAGLE-3's from ``eagle3`` when given.

    Raises:
        FileNotFoundError: neither drafter has an eval report in its folder.
    """
    dirs = _arm_dirs(results, eagle3)
    ev = {m: _load(dirs[m], n, "eval") for m, n in NAMES.items()}
    if not any(ev.values()):
        raise FileNotFoundError(f"no <name>-eval.json in {', '.join(sorted({str(d) for d in dirs.values()}))}: "
                                "run the experiment's eval step first")
    datasets = [d for d in ("mt_bench", "humaneval", "heldout") if any(e and d in e["datasets"] for e in ev.values())]
    return ev, datasets


def _row(ev: dict | None, dataset: str, K: int) -> dict | None:
    if not ev or dataset not in ev.get("datasets", {}):
        return None
    return next((r for r in ev["datasets"][dataset]["by_K"] if r["K"] == K), None)


def _fmt(x, nd=2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def build(results: Path, evals: tuple[dict, list[str]] | None = None,
          eagle3: Path | None = None) -> tuple[str, dict]:
    """(Markdown, JSON-able dict) of the comparison; missing runs show as '—'. ``eagle3``: the EAGLE-3 arm's
    folder when it trained in a lease of its own (default ``results``).

    Raises:
        FileNotFoundError: neither drafter has an eval report in its folder.
    """
    ev, datasets = evals or _load_evals(results, eagle3)
    dirs = _arm_dirs(results, eagle3)
    tr = {m: _load(dirs[m], n, "train-metrics") for m, n in NAMES.items()}
    out: dict = {"acceptance_length": {}, "draft_ms": {}, "speedup": {}, "sim_vs_measured": {}, "train": {}}
    md = ["## Acceptance length (reference loop, batch 1, greedy)", "",
          "| dataset | K | P-EAGLE AL | EAGLE-3 AL | ratio |", "|---|---|---|---|---|"]
    for d in datasets:
        for K in (3, 5, 7):
            p, e = _row(ev["peagle"], d, K), _row(ev["eagle3"], d, K)
            pa, ea = (p or {}).get("acceptance_length"), (e or {}).get("acceptance_length")
            ratio = pa / ea if pa and ea else None
            out["acceptance_length"][f"{d}/K{K}"] = {"peagle": pa, "eagle3": ea, "ratio": ratio}
            md.append(f"| {d} | {K} | {_fmt(pa)} | {_fmt(ea)} | {_fmt(ratio)} |")
    md += ["", "## Drafting ms per verification round (mt_bench, steady state)", "",
           "| drafter | " + " | ".join(f"K={k}" for k in range(1, 8)) + " | K=7 / K=1 |", "|---" * 9 + "|"]
    for m, label in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
        ms = [(_row(ev[m], "mt_bench", k) or {}).get("draft_ms_per_round") for k in range(1, 8)]
        ratio = ms[6] / ms[0] if ms[0] and ms[6] else None
        out["draft_ms"][m] = {"by_K": ms, "K7_over_K1": ratio}
        md.append(f"| {label} | " + " | ".join(_fmt(x) for x in ms) + f" | {_fmt(ratio)} |")
    md += ["", "## End-to-end tokens/s relative to the target alone (batch 1, same loop)", "",
           "| dataset | drafter | " + " | ".join(f"K={k}" for k in range(1, 8)) + " |", "|---" * 9 + "|"]
    for d in datasets:
        for m, label in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
            sp = [(_row(ev[m], d, k) or {}).get("speedup") for k in range(1, 8)]
            out["speedup"][f"{d}/{m}"] = sp
            md.append(f"| {d} | {label} | " + " | ".join(_fmt(x) for x in sp) + " |")
    md += ["", "## Simulated (end of training) vs measured AL, heldout prompts", "",
           "| drafter | K | simulated, loop-equivalent (`eval_walk_al_heldout`) | measured (heldout) | gap | "
           "position-averaged `eval_sim_al` (all eval sequences) |", "|---|---|---|---|---|---|"]
    for m, label in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
        final = (tr[m] or {}).get("final") or {}
        for K in (1, 3, 5, 7):
            sim = (final.get("eval_walk_al_heldout") or {}).get(str(K))
            meas = (_row(ev[m], "heldout", K) or {}).get("acceptance_length")
            gap = (meas - sim) / sim if sim and meas and not (math.isnan(sim) or math.isnan(meas)) else None
            pos = (final.get("eval_sim_al") or {}).get(str(K))
            out["sim_vs_measured"][f"{m}/K{K}"] = {"simulated": sim, "measured": meas, "relative_gap": gap,
                                                   "position_averaged": pos}
            md.append(f"| {label} | {K} | {_fmt(sim, 3)} | {_fmt(meas, 3)} | "
                      f"{'—' if gap is None else f'{100 * gap:+.1f} %'} | {_fmt(pos, 3)} |")
    md += ["", "## Training", "", "| drafter | steps | train s | peak GB | final eval loss |", "|---|---|---|---|---|"]
    for m, label in (("peagle", "P-EAGLE"), ("eagle3", "EAGLE-3")):
        t = tr[m] or {}
        last = t.get("last") or {}
        out["train"][m] = {"steps": t.get("steps"), "train_seconds": t.get("train_seconds"),
                           "peak_mem_gb": last.get("peak_mem_gb"), "eval_loss": (t.get("final") or {}).get("eval_loss")}
        md.append(f"| {label} | {t.get('steps', '—')} | {_fmt(t.get('train_seconds'), 0)} | "
                  f"{_fmt(last.get('peak_mem_gb'), 1)} | {_fmt((t.get('final') or {}).get('eval_loss'), 3)} |")
    return "\n".join(md) + "\n", out


def plot(results: Path, out_png: Path, evals: tuple[dict, list[str]] | None = None,
         eagle3: Path | None = None) -> Path:
    """``comparison.png``: acceptance length vs served K per dataset and drafting ms per round vs K,
    P-EAGLE and EAGLE-3 side by side (matplotlib, Agg backend).

    Raises:
        FileNotFoundError: as :func:`build`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev, datasets = evals or _load_evals(results, eagle3)
    fig, axes = plt.subplots(1, len(datasets) + 1, figsize=(4 * (len(datasets) + 1), 3.4))
    ks = list(range(1, 8))
    styles = {"peagle": ("P-EAGLE", "-o"), "eagle3": ("EAGLE-3", "--s")}
    for ax, d in zip(axes, datasets):
        for m, (label, st) in styles.items():
            al = [(_row(ev[m], d, k) or {}).get("acceptance_length") for k in ks]
            if any(a is not None for a in al):
                ax.plot(ks, [float("nan") if a is None else a for a in al], st, label=label)
        ax.set(title=f"{d}: acceptance length", xlabel="served K", ylabel="AL")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[-1]
    for m, (label, st) in styles.items():
        ms = [(_row(ev[m], "mt_bench", k) or {}).get("draft_ms_per_round") for k in ks]
        if any(x is not None for x in ms):
            ax.plot(ks, [float("nan") if x is None else x for x in ms], st, label=label)
    ax.set(title="drafting ms / round (mt_bench)", xlabel="served K", ylabel="ms")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="folder with the experiment's small result files")
    ap.add_argument("--eagle3", type=Path, default=None, help="the EAGLE-3 arm's folder (a lease of its own)")
    ap.add_argument("--out", type=Path, default=None, help="folder for comparison.{md,json,png} (default: results)")
    args = ap.parse_args(argv)
    out = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    evals = _load_evals(args.results, args.eagle3)
    md, data = build(args.results, evals, args.eagle3)
    (out / "comparison.md").write_text(md)
    (out / "comparison.json").write_text(json.dumps(data, indent=1))
    plot(args.results, out / "comparison.png", evals)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
