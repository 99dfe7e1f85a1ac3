"""Eval report writers: ``eval.json``, ``eval.md`` and PNG plots (matplotlib, Agg canvas).

Input is the results dict of :func:`peagle_train.eval.evaluate.run_eval`. Plots are drawn on a
``matplotlib.figure.Figure`` with an Agg canvas, so no pyplot/global backend state is touched.
"""
from __future__ import annotations

import math
from pathlib import Path

from peagle_train.core.atomic import write_json_atomic

PLOTS = ("acceptance_by_position.png", "al_speedup_vs_k.png")


def _fmt(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def render_markdown(results: dict) -> str:
    """The human-readable report: setup (target, drafter, datasets, K range, prompts, hardware),
    one table per dataset (AL, per-position acceptance, drafting ms/round, tokens/s, speedup) and
    the lossless verdict."""
    hw = results["hardware"]
    ks = results["k_values"]
    names = list(results["datasets"])
    n_prompts = ", ".join(f"{n}: {d['num_prompts']} prompts / {d['num_sequences']} sequences"
                          for n, d in results["datasets"].items())
    ll = results["lossless"]
    lines = [
        f"# Speculative decoding eval: {results['drafter']}",
        "",
        f"- Target: `{results['target']}`",
        f"- Drafter: `{results['drafter']}` ({results['method']}, trained K = {results['trained_K']})",
        f"- Datasets: {', '.join(names)} ({n_prompts}; both MT-Bench turns: {results['both_turns']})",
        f"- Served K: {ks[0]}..{ks[-1]}; greedy decoding, at most {results['max_new_tokens']} new tokens per turn",
        f"- Hardware: {hw['device']} ({hw['device_name']}), {hw['cpu_cores']} CPU cores, "
        f"torch {hw['torch']}, transformers {hw['transformers']}",
        f"- Lossless check: **{'PASSED' if ll['passed'] else 'FAILED'}** "
        f"({ll['checked'] - len(ll['mismatches'])}/{ll['checked']} outputs identical to target-alone greedy)",
        "",
        "Acceptance length (AL) = mean accepted drafts + 1 per verification round. acc@i = rounds "
        "accepting draft i / rounds reaching it. Drafting ms/round excludes each sequence's first "
        "proposal (it also runs the drafter over the prompt). tokens/s include the prefill; speedup is "
        "against target-alone decoding of the same sequences with the same reference loop (batch 1).",
    ]
    for name, d in results["datasets"].items():
        ta = d["target_alone"]
        lines += ["", f"## {name}", "", f"Target alone: {_fmt(ta['tokens_per_s'], 1)} tokens/s "
                  f"({ta['new_tokens']} tokens in {_fmt(ta['seconds'])} s); "
                  f"copyable by a 4-token lookup in their context: {_fmt(ta.get('copyable'))}.", ""]
        head = ["K", "AL"] + [f"acc@{i}" for i in range(1, ks[-1] + 1)] + [
            "draft ms/round", "verify ms/round", "tokens/s", "speedup", "mismatches"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in d["by_K"]:
            acc = [_fmt(a) for a in row["per_position_acceptance"]] + [""] * (ks[-1] - row["K"])
            cells = [str(row["K"]), _fmt(row["acceptance_length"])] + acc + [
                _fmt(row["draft_ms_per_round"]), _fmt(row["verify_ms_per_round"]), _fmt(row["tokens_per_s"], 1),
                _fmt(row["speedup"]), str(row["mismatches"])]
            lines.append("| " + " | ".join(cells) + " |")
    if ll["mismatches"]:
        lines += ["", "## Lossless-check mismatches", "",
                  "| dataset | prompt | turn | K | first differing token | target | speculative | target top-2 margin |",
                  "|---|---|---|---|---|---|---|---|"]
        for m in ll["mismatches"]:
            lines.append(f"| {m['dataset']} | {m['prompt']} | {m['turn']} | {m['K']} | {m['position']} | "
                         f"{m['target_token']} | {m['speculative_token']} | {_fmt(m['target_top2_margin'], 4)} |")
    lines += ["", "![acceptance by position](acceptance_by_position.png)", "",
              "![AL and speedup vs K](al_speedup_vs_k.png)", ""]
    return "\n".join(lines)


def _figure(ncols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * ncols, 4), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


#: one marker per line, in order, so lines that coincide stay distinguishable
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def plot_acceptance_by_position(results: dict, path: str | Path):
    """One panel per dataset: acceptance rate vs draft position, one line per served K.

    Lines often coincide (a parallel drafter's K=2 and K=3 share positions 1-2), so each K gets
    its own marker (:data:`MARKERS`, open, so one drawn over another still shows) and a small
    horizontal offset (at most ±0.15 position) around its integer position.

    Returns:
        The ``matplotlib.figure.Figure`` (also saved to ``path``).
    """
    names = list(results["datasets"])
    fig, axes = _figure(len(names))
    for ax, name in zip(axes, names):
        rows = results["datasets"][name]["by_K"]
        step = min(0.3 / max(len(rows) - 1, 1), 0.08)
        for j, row in enumerate(rows):
            shift = (j - (len(rows) - 1) / 2) * step
            pos = [p + shift for p in range(1, row["K"] + 1)]
            rate = [float("nan") if r is None else r for r in row["per_position_acceptance"]]
            ax.plot(pos, rate, marker=MARKERS[j % len(MARKERS)], fillstyle="none", label=f"K={row['K']}")
        ax.set(title=name, xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
        ax.set_xticks(list(range(1, results["k_values"][-1] + 1)))
        ax.legend(fontsize="small")
    fig.suptitle(f"{results['drafter']}: acceptance by draft position", wrap=True, fontsize="medium")
    fig.savefig(path, dpi=100)
    return fig


def plot_al_speedup(results: dict, path: str | Path):
    """Two panels: acceptance length vs K and speedup vs K, one line (own marker) per dataset.

    The AL axis runs from 1.0 (no draft ever accepted) to the largest bound ``K + 1`` (every draft
    accepted), drawn dashed, so a difference of 0.01 looks as small as it is instead of filling an
    autoscaled axis.

    Returns:
        The ``matplotlib.figure.Figure`` (also saved to ``path``).
    """
    fig, (ax_al, ax_sp) = _figure(2)
    for j, (name, d) in enumerate(results["datasets"].items()):
        ks = [r["K"] for r in d["by_K"]]
        marker = MARKERS[j % len(MARKERS)]
        ax_al.plot(ks, [r["acceptance_length"] for r in d["by_K"]], marker=marker, fillstyle="none", label=name)
        ax_sp.plot(ks, [r["speedup"] for r in d["by_K"]], marker=marker, fillstyle="none", label=name)
    kv = results["k_values"]
    ax_al.plot(kv, [k + 1 for k in kv], color="grey", lw=0.8, ls="--", label="bound K + 1")
    ax_al.set(xlabel="served K", ylabel="acceptance length (tokens/round)", title="Acceptance length",
              ylim=(1.0, kv[-1] + 1 + 0.05 * kv[-1]))
    ax_sp.set(xlabel="served K", ylabel="speedup vs target alone", title="Speedup")
    ax_sp.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (ax_al, ax_sp):
        ax.set_xticks(kv)
        ax.legend(fontsize="small")
    fig.suptitle(f"{results['drafter']} on {results['target']}", wrap=True, fontsize="medium")
    fig.savefig(path, dpi=100)
    return fig


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``eval.json`` (strict JSON, NaN → null), ``eval.md`` and the PNG plots.

    Returns:
        ``{"json", "md", "acceptance_by_position", "al_speedup_vs_k"}`` → paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "md": out / "eval.md"}
    write_json_atomic(paths["json"], results, indent=2)
    paths["md"].write_text(render_markdown(results))
    for fn, name in zip((plot_acceptance_by_position, plot_al_speedup), PLOTS):
        paths[name[:-4]] = out / name
        fn(results, out / name)
    return paths
